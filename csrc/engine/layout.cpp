#include "engine/layout.h"

namespace torch_odc {

namespace {
size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

RegionLayout::RegionLayout(std::vector<KeySpec> keys) : keys_(std::move(keys)) {
  size_t off = 4 * kAlign;  // control words, each on its own cache line pair
  offsets_.resize(keys_.size());
  for (auto& o : offsets_) {
    o.published_flag = off;
    off += kAlign;
    o.pushed_flag = off;
    off += kAlign;
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    auto& o = offsets_[k];
    o.num_locks = (keys_[k].accum_numel + kLockBlockElems - 1) / kLockBlockElems;
    o.first_lock = off;
    off = alignUp(off + o.num_locks * sizeof(uint32_t), kAlign);
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    offsets_[k].cache = off;
    off = alignUp(off + keys_[k].shardBytes(), kAlign);
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    offsets_[k].accum = off;
    off = alignUp(off + keys_[k].accumBytes(), kAlign);
  }
  bytes_ = off;
}

std::string RegionLayout::digest() const {
  std::string out;
  for (const auto& k : keys_) {
    out += k.name + ':' + std::to_string(k.shard_numel) + ':' + dtypeName(k.gather_dtype) + ':' +
           std::to_string(k.accum_numel) + ':' + dtypeName(k.reduce_dtype) + ';';
  }
  return out;
}

}  // namespace torch_odc
