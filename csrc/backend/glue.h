// What the parts of the backend's on-demand glue share (keyed_calls.cpp, shard_cache.cpp,
// barrier.cpp): ODC operations as profiler ranges, engine errors as c10::Error, the host clocks
// of the keyed entry points, the store as the engine's rendezvous and the dtype mapping.
#pragma once

#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "backend/device.h"
#include "backend/odc_backend.h"
#include "engine/rendezvous.h"
#include "engine/types.h"

namespace torch_odc {

// One ODC operation as a range in the PyTorch profiler (record_function, user scope) and, in
// CUDA builds, in NVTX (Nsight Systems). The name is referenced, not copied: it must outlive the
// range (the engine's per-key names do; a temporary string is kept by the owning constructor).
class OpRange {
 public:
  explicit OpRange(const std::string& name) : name_(&name), rf_(at::RecordScope::USER_SCOPE) {
    begin();
  }
  explicit OpRange(const char* name)
      : owned_(name), name_(&owned_), rf_(at::RecordScope::USER_SCOPE) {
    begin();
  }
  ~OpRange() { device::rangePop(); }
  OpRange(const OpRange&) = delete;
  OpRange& operator=(const OpRange&) = delete;

 private:
  void begin() {
    if (rf_.isActive()) rf_.before(std::string_view(*name_), c10::ArrayRef<const c10::IValue>{});
    device::rangePush(name_->c_str());
  }
  std::string owned_;
  const std::string* name_;  // outlives rf_, which may keep a view of it
  at::RecordFunction rf_;
};

// Translates errors of the engine and its transport into c10::Error with the same text.
template <typename F>
void engineCall(F&& f) {
  try {
    f();
  } catch (const OdcTimeout& e) {
    TORCH_CHECK(false, e.what());
  } catch (const OdcError& e) {
    TORCH_CHECK(false, e.what());
  }
}

// Adds the host time of its scope to one of the backend's C++ host clocks.
class HostTimer {
 public:
  HostTimer(OdcBackend& backend, OdcBackend::HostOp op)
      : clock_(backend.cpp_host_ns_[static_cast<size_t>(op)]),
        t0_(std::chrono::steady_clock::now()) {}
  ~HostTimer() {
    clock_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_)
            .count(),
        std::memory_order_relaxed);
  }
  HostTimer(const HostTimer&) = delete;
  HostTimer& operator=(const HostTimer&) = delete;

 private:
  std::atomic<int64_t>& clock_;
  std::chrono::steady_clock::time_point t0_;
};

// c10d::Store as the engine's rendezvous.
class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    store_->wait({key}, timeout);
    const auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  bool tryGet(const std::string& key, std::string& value) override {
    if (!store_->check({key})) return false;
    const auto v = store_->get(key);
    value.assign(v.begin(), v.end());
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace torch_odc
