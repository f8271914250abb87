// Publishing shards and the sharded parameters that live in the shard caches
// (OdcBackend::publishShards, evictShards, adoptedBytes: "The shard cache is the sharded
// parameters" in docs/architecture.md).
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/COW.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <optional>

#include "backend/device.h"
#include "backend/glue.h"
#include "backend/odc_backend.h"

namespace torch_odc {

namespace {

// The GPU `device` as a device guard's target; none for the CPU (device < 0).
std::optional<c10::Device> onDevice(int device) {
  if (device < 0) return std::nullopt;
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device));
}

}  // namespace

std::vector<size_t> OdcBackend::publishShards(const std::vector<int64_t>& keys,
                                              const std::vector<std::vector<at::Tensor>>& sources,
                                              bool place_only) {
  HostTimer timer(*this, HostOp::kPublish);
  OpRange range("odc::publish_shards");
  const auto held = engine("publish");
  auto& eng = *held;
  const auto& layout = eng.layout();
  TORCH_CHECK(keys.size() == sources.size(), "odc: rank ", rank_, ": publish of ", keys.size(),
              " keys with ", sources.size(), " source lists");
  const int device = eng.transport().deviceIndex();
  std::vector<size_t> index(layout.numKeys(), SIZE_MAX);  // key -> position in `keys`
  std::vector<size_t> wanted;
  for (size_t i = 0; i < keys.size(); ++i) {
    TORCH_CHECK(keys[i] >= 0 && static_cast<size_t>(keys[i]) < layout.numKeys(), "odc: rank ",
                rank_, ": publish of unknown key #", keys[i]);
    const auto k = static_cast<size_t>(keys[i]);
    const auto& spec = layout.key(k);
    size_t numel = 0;
    for (const auto& t : sources[i]) {
      const bool here =
          device < 0 ? t.device().is_cpu() : (t.device().is_cuda() && t.device().index() == device);
      TORCH_CHECK(here && t.is_contiguous() && t.is_floating_point(), "odc: rank ", rank_,
                  ": the shard of key '", spec.name, "' must be contiguous floating-point ",
                  "tensors on ", device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device),
                  ", got ", t.scalar_type(), " on ", t.device());
      numel += static_cast<size_t>(t.numel());
    }
    TORCH_CHECK(numel == spec.shard_numel, "odc: rank ", rank_, ": the shard of key '", spec.name,
                "' (minibatch ", eng.epoch(), ") has ", numel,
                " elements, but the key was attached with ", spec.shard_numel,
                " (were parameters replaced or resized after torch_odc.attach()? re-attach)");
    index[k] = i;
    wanted.push_back(k);
  }
  c10::OptionalDeviceGuard guard(onDevice(device));
  const Stream stream = device::currentStream(device);
  engineCall([&] { eng.transport().checkErrors(); });
  std::vector<size_t> done;
  if (place_only) {
    std::vector<void*> caches;
    for (const size_t k : wanted) {
      caches.push_back(eng.transport().localPointer(layout.offsets(k).cache));
    }
    engineCall([&] { fillCaches(eng, wanted, caches, index, sources, stream); });
    return done;
  }
  engineCall([&] {
    done = eng.publishWith(
        wanted,
        [&](const std::vector<size_t>& todo, const std::vector<void*>& caches) {
          fillCaches(eng, todo, caches, index, sources, stream);
        },
        stream);
  });
  return done;
}

namespace {

// The context of a DataPtr into the own region: a pin of the region's memory (pinLocal).
void releasePin(void* ctx) { delete static_cast<std::shared_ptr<void>*>(ctx); }

c10::weak_intrusive_ptr<c10::StorageImpl> noStorage() {
  return c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>());
}

}  // namespace

void OdcBackend::evictLocked(Adopted& slot, Stream stream) {
  auto impl = slot.storage.lock();
  slot.storage = noStorage();
  if (!impl || impl->data_ptr().get() != slot.at) return;
  // The parameter leaves the cache: memory of its own from its storage's allocator (on CUDA
  // the caching allocator, on the current stream), the bytes copied over on that stream.
  c10::Allocator* allocator = impl->allocator();
  TORCH_CHECK(allocator, "odc: rank ", rank_,
              ": a parameter living in the shard cache has no allocator to move it back to");
  c10::DataPtr fresh = allocator->allocate(slot.bytes);
  if (slot.bytes > 0) {
    if (impl->device_type() == c10::kCPU) {
      std::memcpy(fresh.get(), slot.at, slot.bytes);
    } else {
      device::copyAsync(fresh.get(), slot.at, slot.bytes, stream);
    }
  }
  impl->set_data_ptr_noswap(std::move(fresh));
}

void OdcBackend::fillCaches(Engine& eng, const std::vector<size_t>& todo,
                            const std::vector<void*>& caches, const std::vector<size_t>& index,
                            const std::vector<std::vector<at::Tensor>>& sources, Stream stream) {
  // Every source tensor of every key to fill, and its place in the key's cache (a view of the
  // region in the key's cache dtype): one multi-tensor copy, which also casts exactly as FSDP2's
  // own all-gather copy-in does where the cache holds the gather dtype. The cache views name
  // their device: from_blob would otherwise ask the driver where each pointer lives (one query
  // per tensor, ~150 per minibatch for a 16-layer model). FSDP2's shards are flat already and
  // are passed as they are. A source that lives in its place already is not copied.
  const auto& layout = eng.layout();
  const int device = eng.transport().deviceIndex();
  const c10::Device on = device >= 0
                             ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))
                             : c10::Device(c10::kCPU);
  std::shared_ptr<void> pin = eng.transport().pinLocal();
  struct Adopt {
    at::Tensor source;
    void* at;
    size_t slot;
    size_t bytes;
  };
  std::vector<Adopt> adopt;
  std::vector<at::Tensor> dst, src;
  std::lock_guard<std::mutex> lock(adopt_mu_);
  if (adopted_.size() != layout.numParams()) adopted_.assign(layout.numParams(), Adopted{});
  for (size_t n = 0; n < todo.size(); ++n) {
    const auto& spec = layout.key(todo[n]);
    const DType cache = spec.cacheDtype();
    const auto options = at::TensorOptions().dtype(toScalarType(cache)).device(on);
    const size_t first = layout.offsets(todo[n]).first_param;
    const auto& list = sources[index[todo[n]]];
    TORCH_CHECK(list.size() == spec.grad_numels.size(), "odc: rank ", rank_, ": the shard of key '",
                spec.name, "' came as ", list.size(), " tensors for its ", spec.grad_numels.size(),
                " parameters");
    auto* at_byte = static_cast<uint8_t*>(caches[n]);
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& t = list[i];
      const size_t bytes = static_cast<size_t>(t.numel()) * elementSize(cache);
      if (t.numel() == 0) continue;
      void* here = at_byte;
      at_byte += bytes;
      if (t.data_ptr() == here) continue;  // the parameter lives in its place
      // Whatever lived here leaves first (its bytes are about to be overwritten): FSDP2
      // replaced the parameter's storage (lazy init's re-padding, _apply).
      evictLocked(adopted_[first + i], stream);
      dst.push_back(
          at::for_blob(here, {t.numel()}).options(options).target_device(on).make_tensor());
      src.push_back(t.dim() == 1 ? t : t.view({t.numel()}));
      const auto& storage = t.storage();
      if (pin && t.scalar_type() == toScalarType(cache) && t.storage_offset() == 0 &&
          storage.nbytes() == bytes && storage.data_ptr().get() == t.data_ptr() &&
          storage.data_ptr().get_deleter() != &releasePin &&
          !c10::impl::cow::is_cow_data_ptr(storage.data_ptr())) {
        adopt.push_back({t, here, first + i, bytes});
      }
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  for (auto& a : adopt) {
    c10::StorageImpl* impl = a.source.storage().unsafeGetStorageImpl();
    c10::DataPtr old =
        impl->set_data_ptr(c10::DataPtr(a.at, new std::shared_ptr<void>(pin), &releasePin, on));
    // The copy above still reads the old block on this stream: no reuse before it completes.
    if (device >= 0) device::recordStream(old, device);
    adopted_[a.slot] = Adopted{a.source.storage().getWeakStorageImpl(), a.at, a.bytes};
  }
}

void OdcBackend::evictShards() {
  const auto held = engine("detach");
  const int device = held->transport().deviceIndex();
  c10::OptionalDeviceGuard guard(onDevice(device));
  const Stream stream = device::currentStream(device);
  std::lock_guard<std::mutex> lock(adopt_mu_);
  for (auto& slot : adopted_) evictLocked(slot, stream);
  adopted_.clear();
}

size_t OdcBackend::adoptedBytes() {
  std::lock_guard<std::mutex> lock(adopt_mu_);
  size_t bytes = 0;
  for (const auto& slot : adopted_) {
    const auto impl = slot.storage.lock();
    if (impl && impl->data_ptr().get() == slot.at) bytes += slot.bytes;
  }
  return bytes;
}

}  // namespace torch_odc
