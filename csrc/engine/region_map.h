// Where this process has every rank's region and accumulators mapped, and the address of a layout
// offset in them: the addressing every transport shares. Offsets below the layout's accumBegin()
// lie in a rank's region (mapped at connect, for the transport's lifetime); offsets from it on lie
// in the rank's accumulators, one allocation per generation, mapped and unmapped as they come and
// go (engine.h, "Gradient memory").
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/layout.h"
#include "engine/types.h"

namespace torch_odc {

struct RegionMap {
  explicit RegionMap(int world) : bases(static_cast<size_t>(world), nullptr) {}

  // At connect: where `layout`'s accumulators begin, and none of them mapped yet.
  void setLayout(const RegionLayout& layout, int world) {
    accum_begin = layout.accumBegin();
    acc_bytes = layout.accumRegionBytes();
    acc_bases.assign(static_cast<size_t>(world), nullptr);
  }

  // The address of `offset` in rank `peer`'s region or accumulators, as mapped by rank `rank`
  // (this process); an error naming both ranks where that memory is not mapped.
  uint8_t* at(int rank, int peer, size_t offset) const {
    if (offset >= accum_begin && acc_bytes > 0) {
      uint8_t* acc = acc_bases.at(static_cast<size_t>(peer));
      if (!acc) {
        throw OdcError("odc: rank " + std::to_string(rank) +
                       ": the gradient accumulators of rank " + std::to_string(peer) +
                       " are not mapped (freed by torch_odc.free_gradient_memory(), or the "
                       "transport closed)");
      }
      return acc + (offset - accum_begin);
    }
    uint8_t* base = bases.at(static_cast<size_t>(peer));
    if (!base) {
      throw OdcError("odc: rank " + std::to_string(rank) + ": region of rank " +
                     std::to_string(peer) + " is not mapped (transport closed?)");
    }
    return base + offset;
  }

  std::vector<uint8_t*> bases;  // index = rank; bases[rank] is the own region
  // The accumulators of the current generation (index = rank; null: not mapped), which begin at
  // layout offset accum_begin and span acc_bytes (0: the layout has none).
  std::vector<uint8_t*> acc_bases;
  size_t accum_begin = 0;
  size_t acc_bytes = 0;
};

}  // namespace torch_odc
