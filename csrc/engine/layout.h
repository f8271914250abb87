// The layout of one rank's ODC region. Every rank of a group has a region with this same layout,
// so an offset computed here addresses the same thing in any peer's region.
//
//   control   : per-rank barrier words (arrived epoch), the owner's pid (for messages), its life
//               lock (a robust process-shared mutex, see shm_transport.h), its live count of
//               unkeyed collectives, and per minibatch parity what it reported at arrival (that
//               count and the bitmap of parameters it pushed); host memory
//   flags     : per key: published epoch of the shard cache; one ready flag: the minibatches
//               whose gradients this rank released (its accumulators take pushes of the next)
//   locks     : per key and accumulator block: a spinlock word (CPU accumulation only)
//   caches    : per key: this rank's shard, written only by the owner: the all-gather input, or
//               (cache dtype fp32 under bf16/fp16 mixed precision) the fp32 sharded parameters
//               themselves, which readers round to the gather dtype as they copy
//   accums    : per key: this rank's gradient accumulator (fp32; fp64 for fp64 models), one
//               span per trainable parameter, added into by every pusher. The accumulators are
//               a separate allocation (offsets from accumBegin() on address it), made anew for
//               each generation: free_gradient_memory() returns it between minibatches, and
//               the next generation is allocated zeroed (Engine::freeAccumulators).
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "engine/types.h"

namespace torch_odc {

struct KeySpec {
  std::string name;        // identical on every rank (the module's qualified name)
  size_t shard_numel = 0;  // all-gather input elements per rank
  DType gather_dtype = DType::kFloat32;
  // Per parameter of the key, in FSDP2's order: the elements of its (padded) shard, i.e. its span
  // in each rank's chunk of a reduce-scatter input and in the accumulator; 0 for a frozen
  // parameter, which has no accumulator span and may not be pushed.
  std::vector<size_t> grad_numels;
  DType accum_dtype = DType::kFloat32;  // whatever dtype pushes arrive in (fp64: only fp64)
  // The dtype the shard cache holds (unset: the gather dtype). fp32 with a bf16 or fp16 gather
  // dtype: the cache holds the sharded fp32 parameters (the bytes FSDP2 casts from) and every
  // read rounds them to the gather dtype (round to nearest even, as FSDP2's cast does).
  std::optional<DType> cache_dtype;

  DType cacheDtype() const { return cache_dtype.value_or(gather_dtype); }
  // The all-gather input's bytes (gather dtype) and the shard cache's (cache dtype).
  size_t shardBytes() const { return shard_numel * elementSize(gather_dtype); }
  size_t cacheBytes() const { return shard_numel * elementSize(cacheDtype()); }
  // Whether a cache of `cache` can serve a gather of `gather`: the same dtype, or fp32 read as
  // bf16/fp16.
  static bool servable(DType cache, DType gather) {
    return cache == gather ||
           (cache == DType::kFloat32 && (gather == DType::kBFloat16 || gather == DType::kFloat16));
  }
  size_t accumNumel() const {
    return std::accumulate(grad_numels.begin(), grad_numels.end(), size_t{0});
  }
  size_t accumBytes() const { return accumNumel() * elementSize(accum_dtype); }
};

struct KeyOffsets {
  size_t published_flag = 0;
  size_t first_lock = 0;
  size_t num_locks = 0;
  size_t cache = 0;
  size_t accum = 0;
  size_t accum_numel = 0;
  size_t first_param = 0;           // the key's first bit in the pushed-parameters bitmap
  std::vector<size_t> param_accum;  // element offset of each parameter's accumulator span
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
  size_t controlPid() const { return 2 * kAlign; }
  // A robust process-shared mutex that the owner holds for as long as its transport is
  // connected (peers' liveness check; host transports only). One cache-line pair.
  size_t controlLife() const { return 3 * kAlign; }
  // Cumulative count of this rank's collectives outside keyed calls since connect.
  size_t controlCollectives() const { return 4 * kAlign; }
  // The generation of accumulators this rank has allocated (and described in its blob), and
  // the generation of its peers' accumulators it has unmapped (Engine::freeAccumulators).
  size_t controlAccumGen() const { return 5 * kAlign; }
  size_t controlAccumClosed() const { return 5 * kAlign + sizeof(uint64_t); }
  // The generation of every peer's accumulators this rank has mapped.
  size_t controlAccumOpened() const { return 5 * kAlign + 2 * sizeof(uint64_t); }
  // What a peer needs to map this rank's accumulators (a shared-memory name, a CUDA IPC
  // handle): a length word, then up to kAccumBlobBytes bytes.
  static constexpr size_t kAccumBlobBytes = 2 * kAlign - sizeof(uint64_t);
  size_t controlAccumBlob() const { return 6 * kAlign; }
  // What this rank reported when it arrived at the barrier of a minibatch of this parity (epoch %
  // 2): its collectives count, then the bitmap (bit p: parameter p over all keys, in key order,
  // got a gradient from its pushes). Written before `arrived`, read by peers after it. Two
  // copies: a rank may arrive at minibatch e+1 while a slow peer still reads its report of e
  // (no rank waits for the others between arrive and its next minibatch any more), but not at
  // e+2 before every peer arrived at e+1, which each does only after reading e.
  size_t controlArrivalCollectives(uint64_t epoch) const {
    return 8 * kAlign + (epoch % 2) * arrivalReportBytes();
  }
  size_t controlPushedBits(uint64_t epoch) const {
    return controlArrivalCollectives(epoch) + sizeof(uint64_t);
  }
  size_t pushedBitWords() const { return (num_params_ + 63) / 64; }
  size_t arrivalReportBytes() const {
    return (sizeof(uint64_t) * (1 + pushedBitWords()) + kAlign - 1) / kAlign * kAlign;
  }
  // The ready flag (device-visible, like the published flags): the number of minibatches whose
  // gradients this rank has released. A push into this rank's accumulators in minibatch e waits
  // for it to reach e - 1.
  size_t readyFlag() const { return ready_flag_; }
  // Bytes by use (what torch_odc.stats() reports): shard caches, accumulators, and the rest
  // (control words, flags, lock words, alignment).
  size_t cacheBytes() const { return cache_bytes_; }
  size_t accumBytes() const { return accum_bytes_; }
  // Where the accumulators begin: the region proper is [0, accumBegin()), the accumulators'
  // allocation [accumBegin(), bytes()) (at least kAlign bytes, so that it always exists).
  size_t accumBegin() const { return accum_begin_; }
  size_t accumRegionBytes() const { return bytes_ - accum_begin_; }
  // Bytes of the control words: a transport that keeps them apart (CUDA IPC) sizes them so.
  size_t controlBytes() const { return control_bytes_; }
  size_t numParams() const { return num_params_; }
  // A layout of the control words only (no keys), for a transport's separate control region.
  RegionLayout controlOnly() const;
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
  size_t control_bytes_ = 0;
  size_t ready_flag_ = 0;
  size_t accum_begin_ = 0;
  size_t cache_bytes_ = 0;
  size_t accum_bytes_ = 0;
  size_t num_params_ = 0;
};

}  // namespace torch_odc
