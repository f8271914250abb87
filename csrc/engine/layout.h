// The layout of one rank's ODC region. Every rank of a group has a region with this same layout,
// so an offset computed here addresses the same thing in any peer's region.
//
//   control   : per-rank barrier words (arrived epoch, released epoch), the owner's pid (for
//               messages) and its life lock (a robust process-shared mutex, see shm_transport.h),
//               host memory
//   flags     : per key: published epoch of the shard cache, last epoch a push landed
//   locks     : per key and accumulator block: a spinlock word (CPU accumulation only)
//   caches    : per key: this rank's shard (the all-gather input), written only by the owner
//   accums    : per key: this rank's gradient accumulator, added into by every pusher
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/types.h"

namespace torch_odc {

struct KeySpec {
  std::string name;        // identical on every rank (the module's qualified name)
  size_t shard_numel = 0;  // all-gather input elements per rank
  DType gather_dtype = DType::kFloat32;
  size_t accum_numel = 0;  // reduce-scatter output elements per rank
  DType reduce_dtype = DType::kFloat32;

  size_t shardBytes() const { return shard_numel * elementSize(gather_dtype); }
  size_t accumBytes() const { return accum_numel * elementSize(reduce_dtype); }
};

struct KeyOffsets {
  size_t published_flag = 0;
  size_t pushed_flag = 0;
  size_t first_lock = 0;
  size_t num_locks = 0;
  size_t cache = 0;
  size_t accum = 0;
};

class RegionLayout {
 public:
  // Accumulator elements guarded by one lock word: pushers into different blocks of one key
  // proceed in parallel.
  static constexpr size_t kLockBlockElems = size_t{1} << 16;
  static constexpr size_t kAlign = 128;

  RegionLayout() = default;
  explicit RegionLayout(std::vector<KeySpec> keys);

  size_t bytes() const { return bytes_; }
  size_t controlArrived() const { return 0; }
  size_t controlReleased() const { return kAlign; }
  size_t controlPid() const { return 2 * kAlign; }
  // A robust process-shared mutex that the owner holds for as long as its transport is
  // connected (peers' liveness check; host transports only). One cache-line pair.
  size_t controlLife() const { return 3 * kAlign; }
  const std::vector<KeySpec>& keys() const { return keys_; }
  const KeySpec& key(size_t k) const { return keys_.at(k); }
  const KeyOffsets& offsets(size_t k) const { return offsets_.at(k); }
  size_t numKeys() const { return keys_.size(); }
  // A digest of names, sizes and dtypes: equal on every rank iff the layouts are.
  std::string digest() const;

 private:
  std::vector<KeySpec> keys_;
  std::vector<KeyOffsets> offsets_;
  size_t bytes_ = 0;
};

}  // namespace torch_odc
