#include "engine/layout.h"

#include <algorithm>

namespace torch_odc {

namespace {
size_t alignUp(size_t v, size_t a) { return (v + a - 1) / a * a; }
}  // namespace

RegionLayout::RegionLayout(std::vector<KeySpec> keys) : keys_(std::move(keys)) {
  offsets_.resize(keys_.size());
  for (size_t k = 0; k < keys_.size(); ++k) {
    auto& o = offsets_[k];
    o.first_param = num_params_;
    num_params_ += keys_[k].grad_numels.size();
    size_t at = 0;
    for (const size_t n : keys_[k].grad_numels) {
      o.param_accum.push_back(at);
      at += n;
    }
    o.accum_numel = at;
  }
  // Control words, each on its own cache line pair, then the pushed-parameters bitmap.
  control_bytes_ = controlArrivalCollectives(0) + 2 * arrivalReportBytes();
  size_t off = control_bytes_;
  ready_flag_ = off;
  off += kAlign;
  for (auto& o : offsets_) {
    o.published_flag = off;
    off += kAlign;
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    auto& o = offsets_[k];
    o.num_locks = (o.accum_numel + kLockBlockElems - 1) / kLockBlockElems;
    o.first_lock = off;
    off = alignUp(off + o.num_locks * sizeof(uint32_t), kAlign);
  }
  for (size_t k = 0; k < keys_.size(); ++k) {
    offsets_[k].cache = off;
    off = alignUp(off + keys_[k].cacheBytes(), kAlign);
    cache_bytes_ += keys_[k].cacheBytes();
  }
  accum_begin_ = off;
  for (size_t k = 0; k < keys_.size(); ++k) {
    offsets_[k].accum = off;
    off = alignUp(off + keys_[k].accumBytes(), kAlign);
    accum_bytes_ += keys_[k].accumBytes();
  }
  bytes_ = std::max(off, accum_begin_ + kAlign);
}

RegionLayout RegionLayout::controlOnly() const {
  RegionLayout out;
  out.bytes_ = out.control_bytes_ = out.accum_begin_ = control_bytes_;
  out.num_params_ = num_params_;
  return out;
}

std::string RegionLayout::digest() const {
  std::string out;
  for (const auto& k : keys_) {
    out += k.name + ':' + std::to_string(k.shard_numel) + ':' + dtypeName(k.gather_dtype) + ':';
    for (size_t i = 0; i < k.grad_numels.size(); ++i) {
      out += (i ? "," : "") + std::to_string(k.grad_numels[i]);
    }
    out += std::string(":") + dtypeName(k.accum_dtype) + ':' + dtypeName(k.cacheDtype()) + ';';
  }
  return out;
}

}  // namespace torch_odc
