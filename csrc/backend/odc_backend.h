// The "odc" c10d backend: one c10d::Backend that serves CPU and CUDA tensors.
//
// Collectives are forwarded, with unchanged semantics, to an inner backend chosen by the device of
// the tensors: Gloo for CPU tensors, NCCL for CUDA tensors. The inner backends are created in
// Python (the torch wheel ships no Gloo headers) on their own PrefixStores; the NCCL one lazily,
// on the first CUDA collective, through a factory, so CPU-only programs never touch CUDA.
//
// Where it lives: odc_backend.cpp (c10d: routing, forwarding, coalescing, lifetime),
// keyed_calls.cpp (the engine's lifecycle and the keyed gathers and pushes), shard_cache.cpp
// (publishing shards, the parameters that live in the shard caches), barrier.cpp (the minibatch
// barrier and gradient memory); what differs with CUDA is behind device.h.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "engine/engine.h"

namespace torch_odc {

class OdcBackend : public c10d::Backend {
 public:
  using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
  using BackendFactory = std::function<BackendPtr()>;

  OdcBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
             std::chrono::milliseconds timeout, BackendPtr cpu_backend,
             BackendFactory cuda_factory);
  ~OdcBackend() override;

  const std::string getBackendName() const override { return "odc"; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const c10::intrusive_ptr<c10d::Store>& store() const { return store_; }

  // The inner backend for a device type; creates the CUDA one on first use.
  BackendPtr inner(c10::DeviceType device);
  // The inner CUDA backend if it was created, else null (never creates it).
  BackendPtr cudaBackendIfCreated();
  BackendPtr cpuBackend() const { return cpu_; }
  // Whether this process can run CUDA collectives (an inner NCCL backend exists or can be made).
  bool hasCuda() const;

  // Plain collectives, forwarded by device.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void setTimeout(std::chrono::milliseconds timeout) override;
  void setGroupUid(const std::string& pg_uid) override;
  // Coalescing (batch_isend_irecv, _coalescing_manager with a device): the device is known only
  // at the first coalesced op. CUDA ops are coalesced by NCCL (its group semantics are what make
  // a P2P ring legal); CPU ops run at once on Gloo and endCoalescing returns one Work over them.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  // Splitting is left to torch's generic path (new_group creates a fresh "odc" backend).
  bool supportsSplitting() const override { return false; }

  // ---- on-demand mode (keyed calls; see engine/engine.h) ----
  // Collective over the group: creates the engine and its transport for these keys.
  // device_index < 0: shared-memory transport (CPU tensors); otherwise CUDA IPC on that device.
  void connectEngine(const std::vector<KeySpec>& keys, int device_index);
  void disconnectEngine();
  // The connected engine; raises naming `op` if none. A caller keeps it alive for its call, so
  // an abort() or detach from another thread never frees an engine in use.
  std::shared_ptr<Engine> engine(const char* op);
  // The keyed calls (keyed_calls.cpp): the one way into the engine's gather and push, made by
  // torch_odc's FSDP2 comm objects directly (no c10d dispatch: every c10d collective of this
  // backend is forwarded), on the caller's current stream. With async_op false they return null,
  // as c10d's all_gather_into_tensor / reduce_scatter_tensor do after waiting (the op is ordered
  // on the stream; FSDP2 orders its streams by events); with async_op true a Work whose wait()
  // makes the current stream wait for it. `params`: the parameters the push's input covers, in
  // order (empty: every trainable one, through the runs merged at connect); `scale`: a factor on
  // top of the reduce op's (FSDP2's post-division).
  c10::intrusive_ptr<c10d::Work> keyedAllgatherCall(int key, at::Tensor& output, at::Tensor& input,
                                                    bool async_op);
  c10::intrusive_ptr<c10d::Work> keyedReduceScatterCall(int key, at::Tensor& output,
                                                        at::Tensor& input, const c10d::ReduceOp& op,
                                                        const std::vector<uint32_t>& params,
                                                        double scale, bool async_op);
  // Shard adoption (shard_cache.cpp). Publishes every key of `keys` this rank has not published in
  // this minibatch, by copying `sources[i]` (the all-gather input of keys[i], as tensors laid back
  // to back: FSDP2's padded sharded parameters, cast to the key's gather dtype by the copy) into
  // its shard cache, all keys in one multi-tensor copy on the current stream, then releasing their
  // flags. Returns the keys it published.
  //
  // A key whose cache dtype is its sources' dtype (KeySpec::cache_dtype) takes its sharded
  // parameters in: a source whose storage is its own (FSDP2's padded flat shard of one
  // parameter: offset 0, exactly its bytes) is re-pointed at its place in the cache after the
  // copy, so the parameter lives there (no second copy of it; every view of the storage, the
  // DTensor parameter the optimizer steps included, sees the region) and later publishes of it
  // copy nothing. The region's memory stays allocated while such a storage lives.
  // `place_only`: every key's cache is filled (adopting as above), no flag is released: at
  // attach, before the first minibatch.
  std::vector<size_t> publishShards(const std::vector<int64_t>& keys,
                                    const std::vector<std::vector<at::Tensor>>& sources,
                                    bool place_only = false);
  // Moves every parameter living in a shard cache back into memory of its own (its storage's
  // allocator), on the current stream: before detach frees the region.
  void evictShards();
  // Bytes of the shard caches that are parameters living there (not a second copy).
  size_t adoptedBytes();
  // The barrier and gradient memory (barrier.cpp). The two phases of the minibatch barrier
  // (engine arrive / release), errors as c10::Error.
  void barrierArrive();
  void barrierRelease(bool zero);
  // Gradient memory (engine.h): collective, errors as c10::Error.
  void freeAccumulators();
  void restoreAccumulators();
  // Raises a device-side wait timeout of the engine connected as `generation`, if it is still
  // the connected one (a keyed CUDA Work checks at wait()).
  void checkDeviceErrors(int generation);
  bool hasEngine() const;
  // Collective over the group: "" when the CUDA IPC transport can run on `device_index` with
  // every rank's GPU (peer access with native atomics, kernels for each GPU), otherwise why not,
  // identical on every rank (torch_odc.attach then keeps collective semantics with a warning).
  std::string cudaTransportProblem(int device_index);

  void shutdown() override;
  void abort() override;
  bool isShutdown() const;

 private:
  // shutdown() and abort(): closes the inner backends the same way and releases them.
  void close(bool abort);
  // The keyed operations themselves (on the current stream; no Work).
  void keyedAllgather(Engine& eng, int key, at::Tensor& output, at::Tensor& input);
  void keyedReduceScatter(Engine& eng, int key, at::Tensor& output, at::Tensor& input,
                          const c10d::ReduceOp& op, const std::vector<uint32_t>& params,
                          double extra_scale);
  // The stream keyed ops of these tensors run on (the caller's current CUDA stream, or none on
  // the CPU), after checking that they live where the engine's transport does.
  Stream keyedStream(Engine& eng, const at::Tensor& a, const at::Tensor& b, const char* op,
                     int key);
  c10::intrusive_ptr<c10d::Work> keyedWork(c10d::OpType type, const at::Tensor& output,
                                           const at::Tensor& input);
  c10::DeviceType deviceOf(const std::vector<at::Tensor>& tensors, const char* op) const;
  c10::DeviceType deviceOf(const std::vector<std::vector<at::Tensor>>& lists, const char* op) const;
  void checkAlive(const char* op) const;
  // Counts a forwarded collective while a model is attached (see Engine::noteCollective).
  void noteCollective(c10d::OpType type);
  // The inner backend for an op on `device`, entering the coalescing mode on the first op.
  BackendPtr route(c10::DeviceType device);
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> forward(c10::DeviceType device, Call&& call) {
    auto backend = route(device);
    auto work = call(*backend);
    if (work) noteCollective(work->retrieveOpType());
    if (coalescing_ == Coalescing::kCpu && work) {
      coalesced_cpu_works_.push_back(work);
    }
    return work;
  }

  enum class Coalescing { kOff, kPending, kCuda, kCpu };
  Coalescing coalescing_ = Coalescing::kOff;  // touched only by the thread issuing collectives
  std::vector<c10::intrusive_ptr<c10d::Work>> coalesced_cpu_works_;

  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
  BackendPtr cpu_;
  BackendFactory cuda_factory_;
  mutable std::mutex mu_;  // guards the inner backends (cuda_ created lazily) and shutdown_
  BackendPtr cuda_;
  bool shutdown_ = false;
  std::shared_ptr<Engine> engine_;
  // Per parameter slot of the engine's layout (key order), the storage that lives in its place in
  // the shard cache (publishShards), if any.
  struct Adopted {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
    void* at = nullptr;
    size_t bytes = 0;
  };
  std::vector<Adopted> adopted_;
  std::mutex adopt_mu_;  // guards adopted_
  // Fills the caches of `todo` (publishShards); `caches[n]`: where todo[n]'s cache is.
  void fillCaches(Engine& eng, const std::vector<size_t>& todo, const std::vector<void*>& caches,
                  const std::vector<size_t>& index,
                  const std::vector<std::vector<at::Tensor>>& sources, Stream stream);
  // Moves the storage living in `slot`'s place (if it still does) into memory of its own.
  void evictLocked(Adopted& slot, Stream stream);
  int engine_generation_ = 0;
  int support_checks_ = 0;

 public:
  // Host nanoseconds spent inside the keyed entry points' C++ (from the call's entry in C++ to
  // its return: the engine, the transport, the CUDA calls; not pybind's argument conversion nor
  // the Python around it), since the process group was made: the C++ share of
  // torch_odc.stats()["host_by_kind_s"]. Only the issuing thread writes them.
  enum class HostOp : size_t { kGather, kPush, kPublish, kCount };
  double cppHostSeconds(HostOp op) const {
    return static_cast<double>(
               cpp_host_ns_[static_cast<size_t>(op)].load(std::memory_order_relaxed)) *
           1e-9;
  }

 private:
  std::atomic<int64_t> cpp_host_ns_[static_cast<size_t>(HostOp::kCount)] = {};
  friend class HostTimer;
};

// The engine's dtype of a tensor's scalar type (raises for one ODC does not serve), and back.
DType toOdcDtype(at::ScalarType t);
at::ScalarType toScalarType(DType t);

}  // namespace torch_odc
