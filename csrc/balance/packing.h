// Shared packing machinery of the balance planner (internal; planner.h is the public API): the
// index-set type, the first-fit tree, first-fit decreasing by length, Karmarkar-Karp largest
// differencing and the max-load local search. LB-Mini (lb_mini.cpp) and LB-Micro (lb_micro.cpp)
// build on these; packing.cpp also holds the public building blocks that wrap them
// (PartitionKarmarkarKarp, RefineMaxLoad, PackFirstFitDecreasing).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace torch_odc::balance::detail {

// Sets of item positions: the parts of a partition or the bins of a packing.
using Parts = std::vector<std::vector<int>>;

// Relative slack below which a change in cost counts as no change; keeps local search from
// chasing rounding noise.
inline constexpr double kRelTol = 1e-12;

// Max-segment-tree over the free capacity of bins: finds the leftmost bin with room for an item
// in O(log bins). T is int64_t for tokens, double for costs.
template <typename T>
class FirstFit {
 public:
  FirstFit(int max_bins, T cap) : size_(1) {
    while (size_ < max_bins) size_ *= 2;
    tree_.assign(2 * static_cast<size_t>(size_), std::numeric_limits<T>::lowest());
    for (int b = 0; b < max_bins; ++b) tree_[size_ + b] = cap;
    for (int p = size_ - 1; p > 0; --p) tree_[p] = std::max(tree_[2 * p], tree_[2 * p + 1]);
  }
  int Find(T need) const {
    if (tree_[1] < need) return -1;
    int p = 1;
    while (p < size_) {
      p *= 2;
      if (tree_[p] < need) ++p;
    }
    return p - size_;
  }
  void Take(int bin, T amount) {
    int p = bin + size_;
    tree_[p] -= amount;
    for (p /= 2; p > 0; p /= 2) tree_[p] = std::max(tree_[2 * p], tree_[2 * p + 1]);
  }
  T Free(int bin) const { return tree_[size_ + bin]; }

 private:
  int size_;
  std::vector<T> tree_;
};

// Multi-way Karmarkar-Karp largest differencing on positions 0..n-1 of `c` into `k` parts; the
// caller maps positions back to items.
Parts KarmarkarKarp(const double* c, int n, int k);

// Local search on the maximum part: moves and swaps between the most loaded part and any other
// part while that lowers the larger of the two loads, for at most `max_steps` steps. Returns
// the number of improving steps taken.
int64_t Refine(const double* c, Parts* parts_ptr, int64_t max_steps);

// First-fit decreasing by length into bins of at most `cap` tokens (an item longer than `cap`
// gets a bin of its own). Bins come out ordered by total cost, descending.
Parts FirstFitDecreasing(std::vector<int> items, const int64_t* len, const double* c, int64_t cap);

}  // namespace torch_odc::balance::detail
