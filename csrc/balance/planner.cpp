#include "balance/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace torch_odc::balance {
namespace {

using Parts = std::vector<std::vector<int>>;

// Relative slack below which a change in cost counts as no change; keeps local search from
// chasing rounding noise.
constexpr double kRelTol = 1e-12;

// Upper bounds on local-search work; they make planning time predictable for large inputs.
constexpr int64_t kMiniRefineSteps = 2048;
constexpr int kMiniRounds = 3;
constexpr int kPairMaxUnion = 12;                  // 2^11 splits per pair
constexpr int64_t kPairBudget = 4'000'000;         // subset sums visited, over all pair steps
constexpr int64_t kMicroSearchBudget = 1'500'000;  // (bin, sequence) pairs examined
constexpr int kMicroSearchPasses = 16;
constexpr int kMicroTargetBins = 256;
// LB-Mini also tries MULTIFIT when KK and local search end this far above the lower bound.
constexpr double kMultiFitTrigger = 1e-3;
constexpr int kMultiFitIterations = 24;
// Beyond this many sequences per rank, KK runs on the largest ones and the rest are added
// greedily: the small tail only fills gaps, and full KK on 64-tuples would dominate the time.
constexpr int kKarmarkarKarpPerPart = 16;

void Validate(const int64_t* lengths, const double* costs, size_t n, int64_t world_size,
              int64_t cap) {
  if (n == 0) throw std::invalid_argument("balance: lengths must not be empty");
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw std::invalid_argument("balance: too many sequences");
  }
  if (world_size < 1 || world_size > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("balance: world_size must be >= 1, got " +
                                std::to_string(world_size));
  }
  if (cap < 1) {
    throw std::invalid_argument("balance: max_tokens_per_microbatch must be >= 1, got " +
                                std::to_string(cap));
  }
  for (size_t i = 0; i < n; ++i) {
    if (lengths[i] < 1) {
      throw std::invalid_argument("balance: lengths must be positive, got " +
                                  std::to_string(lengths[i]) + " at index " + std::to_string(i));
    }
    if (!std::isfinite(costs[i]) || costs[i] < 0) {
      throw std::invalid_argument("balance: costs must be finite and non-negative, got " +
                                  std::to_string(costs[i]) + " at index " + std::to_string(i));
    }
  }
}

// ---- Karmarkar-Karp largest differencing ----------------------------------------------------

// Partial partitions are k-tuples of subsets kept sorted by sum, descending. Singletons stay
// implicit (item i is the tuple [c_i, 0, ..., 0]) until merged, which saves memory and time
// when n >> k. Subset members are singly linked lists through `next` so merging is O(1) each.
// Works on positions 0..n-1 of `c`; the caller maps them back.
Parts KarmarkarKarp(const double* c, int n, int k) {
  Parts out(k);
  if (k == 1) {
    out[0].resize(n);
    std::iota(out[0].begin(), out[0].end(), 0);
    return out;
  }
  std::vector<int> next(n, -1);
  std::vector<double> sums;
  std::vector<int> heads;
  std::vector<int> tails;
  std::vector<int> free_slots;
  auto alloc = [&]() {
    int s;
    if (!free_slots.empty()) {
      s = free_slots.back();
      free_slots.pop_back();
    } else {
      s = static_cast<int>(sums.size()) / k;
      sums.resize(sums.size() + k);
      heads.resize(heads.size() + k);
      tails.resize(tails.size() + k);
    }
    std::fill_n(sums.begin() + static_cast<size_t>(s) * k, k, 0.0);
    std::fill_n(heads.begin() + static_cast<size_t>(s) * k, k, -1);
    std::fill_n(tails.begin() + static_cast<size_t>(s) * k, k, -1);
    return s;
  };

  struct Entry {
    double diff;
    int id;  // >= 0: slot of a materialized tuple; < 0: singleton item ~id.
  };
  auto lower_priority = [](const Entry& a, const Entry& b) {
    return a.diff < b.diff || (a.diff == b.diff && a.id > b.id);
  };
  std::vector<Entry> init(n);
  for (int i = 0; i < n; ++i) init[i] = Entry{c[i], ~i};
  std::priority_queue<Entry, std::vector<Entry>, decltype(lower_priority)> heap(lower_priority,
                                                                                std::move(init));

  struct Subset {
    double sum;
    int head;
    int tail;
  };
  std::vector<Subset> tmp(k);

  while (heap.size() > 1) {
    Entry a = heap.top();
    heap.pop();
    Entry b = heap.top();
    heap.pop();
    if (a.id < 0 && b.id < 0) {
      int i = ~a.id;
      int j = ~b.id;
      if (c[j] > c[i]) std::swap(i, j);
      const int s = alloc();
      const size_t o = static_cast<size_t>(s) * k;
      sums[o] = c[i];
      heads[o] = tails[o] = i;
      sums[o + 1] = c[j];
      heads[o + 1] = tails[o + 1] = j;
      heap.push(Entry{sums[o] - sums[o + k - 1], s});
      continue;
    }
    if (a.id < 0) std::swap(a, b);
    const int s = a.id;
    double* S = &sums[static_cast<size_t>(s) * k];
    int* H = &heads[static_cast<size_t>(s) * k];
    int* T = &tails[static_cast<size_t>(s) * k];
    if (b.id < 0) {
      const int j = ~b.id;
      S[k - 1] += c[j];
      if (H[k - 1] < 0) {
        H[k - 1] = j;
      } else {
        next[T[k - 1]] = j;
      }
      T[k - 1] = j;
      for (int p = k - 1; p > 0 && S[p] > S[p - 1]; --p) {
        std::swap(S[p], S[p - 1]);
        std::swap(H[p], H[p - 1]);
        std::swap(T[p], T[p - 1]);
      }
    } else {
      const size_t o = static_cast<size_t>(b.id) * k;
      for (int p = 0; p < k; ++p) {
        const int q = k - 1 - p;  // largest of one tuple joins the smallest of the other
        Subset& t = tmp[p];
        t.sum = S[p] + sums[o + q];
        t.head = H[p];
        t.tail = T[p];
        if (heads[o + q] >= 0) {
          if (t.head < 0) {
            t.head = heads[o + q];
          } else {
            next[t.tail] = heads[o + q];
          }
          t.tail = tails[o + q];
        }
      }
      std::sort(tmp.begin(), tmp.end(), [](const Subset& x, const Subset& y) {
        return x.sum > y.sum || (x.sum == y.sum && x.head < y.head);
      });
      for (int p = 0; p < k; ++p) {
        S[p] = tmp[p].sum;
        H[p] = tmp[p].head;
        T[p] = tmp[p].tail;
      }
      free_slots.push_back(b.id);
    }
    heap.push(Entry{S[0] - S[k - 1], s});
  }

  const Entry last = heap.top();
  if (last.id < 0) {
    out[0].push_back(~last.id);
    return out;
  }
  const size_t o = static_cast<size_t>(last.id) * k;
  for (int p = 0; p < k; ++p) {
    for (int x = heads[o + p]; x >= 0; x = next[x]) out[p].push_back(x);
  }
  return out;
}

// ---- local search on the maximum part ------------------------------------------------------

int64_t Refine(const double* c, Parts* parts_ptr, int64_t max_steps) {
  Parts& parts = *parts_ptr;
  const int k = static_cast<int>(parts.size());
  if (k < 2) return 0;
  auto by_cost = [c](int x, int y) { return c[x] < c[y] || (c[x] == c[y] && x < y); };
  auto cost_below = [c](int x, double v) { return c[x] < v; };
  std::vector<double> loads(k, 0.0);
  double total = 0.0;
  double cmax = 0.0;
  for (int p = 0; p < k; ++p) {
    std::sort(parts[p].begin(), parts[p].end(), by_cost);
    for (int x : parts[p]) {
      loads[p] += c[x];
      cmax = std::max(cmax, c[x]);
    }
    total += loads[p];
  }
  const double lower_bound = std::max(total / k, cmax);
  std::vector<int> order(k);

  int64_t steps = 0;
  for (; steps < max_steps; ++steps) {
    const int a = static_cast<int>(std::max_element(loads.begin(), loads.end()) - loads.begin());
    const double la = loads[a];
    const double tol = la * kRelTol;
    if (la <= lower_bound + tol) break;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](int x, int y) { return loads[x] < loads[y] || (loads[x] == loads[y] && x < y); });

    double best = la - tol;
    int best_b = -1;
    int best_x = -1;  // position in parts[a]
    int best_y = -1;  // position in parts[b]; -1 means a move rather than a swap
    const std::vector<int>& A = parts[a];
    auto consider = [&](double d, double lb, int b, int x, int y) {
      const double new_max = std::max(la - d, lb + d);
      if (d > 0 && new_max < best) {
        best = new_max;
        best_b = b;
        best_x = x;
        best_y = y;
      }
    };
    for (int b : order) {
      if (b == a) continue;
      const double lb = loads[b];
      // Whatever moves between a and b, the larger of the two stays >= their mean.
      if ((la + lb) / 2 >= best) break;
      const double half = (la - lb) / 2;
      if (A.size() > 1) {
        const auto it = std::lower_bound(A.begin(), A.end(), half, cost_below);
        if (it != A.end()) consider(c[*it], lb, b, static_cast<int>(it - A.begin()), -1);
        if (it != A.begin())
          consider(c[*(it - 1)], lb, b, static_cast<int>(it - A.begin()) - 1, -1);
      }
      const std::vector<int>& B = parts[b];
      if (B.empty()) continue;
      for (size_t xi = 0; xi < A.size(); ++xi) {
        const double cx = c[A[xi]];
        const auto it = std::lower_bound(B.begin(), B.end(), cx - half, cost_below);
        if (it != B.end()) {
          consider(cx - c[*it], lb, b, static_cast<int>(xi), static_cast<int>(it - B.begin()));
        }
        if (it != B.begin()) {
          consider(cx - c[*(it - 1)], lb, b, static_cast<int>(xi),
                   static_cast<int>(it - B.begin()) - 1);
        }
      }
    }
    if (best_b < 0) break;

    std::vector<int>& PA = parts[a];
    std::vector<int>& PB = parts[best_b];
    const int x = PA[best_x];
    PA.erase(PA.begin() + best_x);
    loads[a] -= c[x];
    loads[best_b] += c[x];
    if (best_y >= 0) {
      const int y = PB[best_y];
      PB.erase(PB.begin() + best_y);
      loads[best_b] -= c[y];
      loads[a] += c[y];
      PA.insert(std::lower_bound(PA.begin(), PA.end(), y, by_cost), y);
    }
    PB.insert(std::lower_bound(PB.begin(), PB.end(), x, by_cost), x);
  }
  return steps;
}

// Exhaustive two-way re-split of part a with a less loaded part, for pairs whose union has at most
// kPairMaxUnion items; reaches exchanges of several items at once, which single moves and swaps
// cannot. With `a` < 0 the most loaded part is used and the step must lower the overall maximum's
// pair; otherwise part `a` is balanced against its best partner. `budget` counts subset sums.
// Returns whether the partition changed.
bool RepartitionPair(const double* c, Parts* parts_ptr, std::vector<double>* loads_ptr, int a,
                     int64_t* budget) {
  Parts& parts = *parts_ptr;
  std::vector<double>& loads = *loads_ptr;
  const int k = static_cast<int>(parts.size());
  if (a < 0) a = static_cast<int>(std::max_element(loads.begin(), loads.end()) - loads.begin());
  const double la = loads[a];
  const double tol = la * kRelTol;
  std::vector<int> order(k);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int x, int y) { return loads[x] < loads[y] || (loads[x] == loads[y] && x < y); });
  double best = la - tol;
  int best_b = -1;
  uint32_t best_mask = 0;
  std::vector<double> pool_cost;
  for (int b : order) {
    if (b == a) continue;
    const double lb = loads[b];
    // Whatever the split, the larger side is at least the pair's mean.
    if ((la + lb) / 2 >= best) break;
    const int u = static_cast<int>(parts[a].size() + parts[b].size());
    if (u > kPairMaxUnion || u < 2) continue;
    const uint32_t count = uint32_t{1} << (u - 1);
    if (*budget < static_cast<int64_t>(count)) break;
    *budget -= count;
    pool_cost.clear();
    for (int x : parts[a]) pool_cost.push_back(c[x]);
    for (int x : parts[b]) pool_cost.push_back(c[x]);
    const double pair_total = la + lb;
    // Gray-code walk over the subsets that exclude the last item: every split up to swapping
    // the two sides, with one add or subtract per subset.
    double sum = 0.0;
    uint32_t mask = 0;
    for (uint32_t g = 1; g < count; ++g) {
      const int bit = __builtin_ctz(g);
      mask ^= uint32_t{1} << bit;
      sum += (mask >> bit & 1) ? pool_cost[bit] : -pool_cost[bit];
      const double m = std::max(sum, pair_total - sum);
      if (m < best) {
        best = m;
        best_b = b;
        best_mask = mask;
      }
    }
  }
  if (best_b < 0) return false;
  std::vector<int> pool(parts[a]);
  pool.insert(pool.end(), parts[best_b].begin(), parts[best_b].end());
  std::vector<int> side_in;
  std::vector<int> side_out;
  double sum_in = 0.0;
  double sum_out = 0.0;
  for (size_t i = 0; i < pool.size(); ++i) {
    if (best_mask >> i & 1) {
      side_in.push_back(pool[i]);
      sum_in += c[pool[i]];
    } else {
      side_out.push_back(pool[i]);
      sum_out += c[pool[i]];
    }
  }
  // The walk accumulates rounding; only an exact improvement counts.
  if (std::max(sum_in, sum_out) >= la - tol) return false;
  parts[a] = std::move(side_in);
  parts[best_b] = std::move(side_out);
  loads[a] = sum_in;
  loads[best_b] = sum_out;
  return true;
}

// KK, then local search: single moves and swaps against the maximum, then rounds of exhaustive
// pair re-splits (every part against its best partner, then the maximum) while they help.
void ImprovePartition(const double* c, Parts* parts) {
  const int k = static_cast<int>(parts->size());
  Refine(c, parts, kMiniRefineSteps);
  int64_t budget = kPairBudget;
  std::vector<double> loads(k);
  for (int round = 0; round < kMiniRounds && budget > 0; ++round) {
    for (int p = 0; p < k; ++p) {
      loads[p] = 0.0;
      for (int x : (*parts)[p]) loads[p] += c[x];
    }
    bool changed = false;
    for (int p = 0; p < k; ++p) changed |= RepartitionPair(c, parts, &loads, p, &budget);
    for (int64_t step = 0; step < kMiniRefineSteps; ++step) {
      if (!RepartitionPair(c, parts, &loads, -1, &budget)) break;
      changed = true;
    }
    if (!changed) break;
    Refine(c, parts, kMiniRefineSteps);
  }
}

// Gives every empty part one item from the part with the most items (only matters when costs
// are zero, since KK leaves no part empty otherwise).
void FillEmptyParts(const double* c, Parts* parts_ptr, int n) {
  Parts& parts = *parts_ptr;
  const int k = static_cast<int>(parts.size());
  if (n < k) return;
  for (int p = 0; p < k; ++p) {
    if (!parts[p].empty()) continue;
    int donor = 0;
    for (int q = 1; q < k; ++q) {
      if (parts[q].size() > parts[donor].size()) donor = q;
    }
    auto it = std::min_element(parts[donor].begin(), parts[donor].end(), [c](int x, int y) {
      return c[x] < c[y] || (c[x] == c[y] && x < y);
    });
    parts[p].push_back(*it);
    parts[donor].erase(it);
  }
}

// ---- first-fit decreasing ------------------------------------------------------------------

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

Parts FirstFitDecreasing(std::vector<int> items, const int64_t* len, const double* c, int64_t cap) {
  std::sort(items.begin(), items.end(), [&](int x, int y) {
    if (len[x] != len[y]) return len[x] > len[y];
    if (c[x] != c[y]) return c[x] > c[y];
    return x < y;
  });
  const int m = static_cast<int>(items.size());
  Parts bins;
  if (m == 0) return bins;
  FirstFit<int64_t> ff(m, cap);
  for (int x : items) {
    int b;
    if (len[x] > cap) {
      b = static_cast<int>(bins.size());
      ff.Take(b, ff.Free(b));
    } else {
      b = ff.Find(len[x]);
      ff.Take(b, len[x]);
    }
    if (b == static_cast<int>(bins.size())) bins.emplace_back();
    bins[b].push_back(x);
  }
  std::vector<double> bin_cost(bins.size(), 0.0);
  for (size_t b = 0; b < bins.size(); ++b) {
    for (int x : bins[b]) bin_cost[b] += c[x];
  }
  std::vector<int> order(bins.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int x, int y) { return bin_cost[x] > bin_cost[y]; });
  Parts sorted;
  sorted.reserve(bins.size());
  for (int b : order) sorted.push_back(std::move(bins[b]));
  return sorted;
}

// ---- LB-Micro --------------------------------------------------------------------------------

struct Bin {
  double cost = 0.0;
  int64_t tokens = 0;
  std::vector<int> items;
  bool sealed = false;  // holds one over-long sequence; nothing else may join it
};

// Cost-balanced packing into `num_bins` bins under the token cap: longest-processing-time
// first, each item to the cheapest bin that has room. Returns false when an item fits nowhere.
bool PackBalanced(const std::vector<int>& by_cost_desc, const std::vector<int>& oversized,
                  const int64_t* len, const double* c, int64_t cap, int num_bins,
                  std::vector<Bin>* out) {
  if (static_cast<int>(oversized.size()) > num_bins) return false;
  std::vector<Bin> bins(num_bins);
  int b = 0;
  for (int x : oversized) {
    bins[b].cost = c[x];
    bins[b].tokens = len[x];
    bins[b].items.push_back(x);
    bins[b].sealed = true;
    ++b;
  }
  auto cheaper = [&](int x, int y) {
    if (bins[x].cost != bins[y].cost) return bins[x].cost > bins[y].cost;
    if (bins[x].items.size() != bins[y].items.size()) {
      return bins[x].items.size() > bins[y].items.size();
    }
    return x > y;
  };
  std::priority_queue<int, std::vector<int>, decltype(cheaper)> heap(cheaper);
  for (; b < num_bins; ++b) heap.push(b);
  // Bins too full for the current sequence wait here, by free tokens, until a sequence short
  // enough comes; with costs that grow with length each bin is parked about once.
  using Parked = std::pair<int64_t, int>;
  std::priority_queue<Parked> parked;
  for (int x : by_cost_desc) {
    while (!parked.empty() && parked.top().first >= len[x]) {
      heap.push(parked.top().second);
      parked.pop();
    }
    int target = -1;
    while (!heap.empty()) {
      const int t = heap.top();
      heap.pop();
      if (bins[t].tokens + len[x] <= cap) {
        target = t;
        break;
      }
      parked.emplace(cap - bins[t].tokens, t);
    }
    if (target < 0) return false;
    bins[target].cost += c[x];
    bins[target].tokens += len[x];
    bins[target].items.push_back(x);
    heap.push(target);
  }
  *out = std::move(bins);
  return true;
}

// Row-by-row packing into `rows` rows of `w` bins (row r holds bins r*w .. r*w+w-1): each row's
// bins are filled, largest sequence first, up to a target cost T_r (the largest remaining cost, or
// the average remaining cost per bin if that is higher), keeping one sequence in reserve for every
// bin still to fill. Rows filled up to their maximum waste nothing of it, which is what the sum of
// row maxima rewards. The last row takes what is left, cheapest bin first. Returns false when the
// last row cannot hold it under the cap.
bool PackRows(const std::vector<int>& by_cost_desc, const std::vector<int>& oversized,
              const int64_t* len, const double* c, int64_t cap, int rows, int w,
              std::vector<Bin>* out) {
  const int num_bins = rows * w;
  if (static_cast<int>(oversized.size()) > num_bins) return false;
  std::vector<Bin> bins(num_bins);
  for (size_t i = 0; i < oversized.size(); ++i) {
    const int x = oversized[i];
    bins[i].cost = c[x];
    bins[i].tokens = len[x];
    bins[i].items.push_back(x);
    bins[i].sealed = true;
  }
  std::set<std::pair<double, int>> pool;
  double remaining_cost = 0.0;
  for (int x : by_cost_desc) {
    pool.emplace(c[x], x);
    remaining_cost += c[x];
  }
  const double tol = (pool.empty() ? 0.0 : pool.rbegin()->first) * kRelTol;
  auto add = [&](Bin* bin, int x) {
    bin->cost += c[x];
    bin->tokens += len[x];
    bin->items.push_back(x);
    remaining_cost -= c[x];
  };
  size_t open_from_here = static_cast<size_t>(num_bins) - oversized.size();
  std::vector<int> open;
  for (int r = 0; r < rows; ++r) {
    open.clear();
    double target = 0.0;
    for (int b = r * w; b < (r + 1) * w; ++b) {
      if (bins[b].sealed) {
        target = std::max(target, bins[b].cost);
      } else {
        open.push_back(b);
      }
    }
    if (r == rows - 1) {
      for (auto it = pool.rbegin(); it != pool.rend(); ++it) {
        Bin* best = nullptr;
        for (int b : open) {
          Bin& bin = bins[b];
          if (bin.tokens + len[it->second] > cap) continue;
          if (best == nullptr || bin.cost < best->cost ||
              (bin.cost == best->cost && bin.items.size() < best->items.size())) {
            best = &bin;
          }
        }
        if (best == nullptr) return false;
        add(best, it->second);
      }
      break;
    }
    if (!pool.empty()) target = std::max(target, pool.rbegin()->first);
    if (open_from_here > 0) target = std::max(target, remaining_cost / open_from_here);
    open_from_here -= open.size();
    for (size_t t = 0; t < open.size(); ++t) {
      Bin& bin = bins[open[t]];
      const size_t reserve = open_from_here + (open.size() - t - 1);
      while (pool.size() > reserve) {
        auto it = pool.upper_bound({target - bin.cost + tol, std::numeric_limits<int>::max()});
        if (it == pool.begin()) break;
        --it;
        // The costliest sequence under the target usually also fits the token budget; a few
        // steps down cover costs that do not grow with length.
        int tries = 0;
        while (len[it->second] > cap - bin.tokens && it != pool.begin() && ++tries < 32) --it;
        if (len[it->second] > cap - bin.tokens) break;
        add(&bin, it->second);
        pool.erase(it);
      }
    }
  }
  *out = std::move(bins);
  return true;
}

// Sorting bins by cost and cutting the order into rows of `w` minimizes the sum over rows of the
// row maximum for a fixed set of bins (the i-th largest row maximum can never be below the
// ((i-1)*w+1)-th largest bin).
std::vector<int> SortedBinOrder(const std::vector<Bin>& bins) {
  std::vector<int> order(bins.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int x, int y) {
    if (bins[x].cost != bins[y].cost) return bins[x].cost > bins[y].cost;
    if (bins[x].items.empty() != bins[y].items.empty()) return bins[y].items.empty();
    return x < y;
  });
  return order;
}

double RowObjective(const std::vector<Bin>& bins, int w) {
  const std::vector<int> order = SortedBinOrder(bins);
  double total = 0.0;
  for (size_t i = 0; i < order.size(); i += w) total += bins[order[i]].cost;
  return total;
}

// Local search on sum over rows of the row maximum: moves and swaps that take cost out of a
// row's most expensive bin and put it where it raises the objective less. Moves never empty a
// bin. Rows are re-cut from the sorted bins between passes, which can only help.
void ImproveRows(const int64_t* len, const double* c, int64_t cap, int w,
                 std::vector<Bin>* bins_ptr) {
  std::vector<Bin>& bins = *bins_ptr;
  const int num_bins = static_cast<int>(bins.size());
  const int rows = num_bins / w;
  double scale = 0.0;
  for (const Bin& bin : bins) scale = std::max(scale, bin.cost);
  const double tol = scale * kRelTol;
  int64_t budget = kMicroSearchBudget;

  std::vector<int> row_of(num_bins);
  std::vector<std::vector<int>> row_bins(rows);
  // Per row: the largest, second and third largest bin costs and the bins holding the first two.
  std::vector<double> v1(rows), v2(rows), v3(rows);
  std::vector<int> i1(rows), i2(rows);
  auto summarize = [&](int r) {
    v1[r] = v2[r] = v3[r] = -1.0;
    i1[r] = i2[r] = -1;
    for (int b : row_bins[r]) {
      const double v = bins[b].cost;
      if (v > v1[r]) {
        v3[r] = v2[r];
        v2[r] = v1[r];
        i2[r] = i1[r];
        v1[r] = v;
        i1[r] = b;
      } else if (v > v2[r]) {
        v3[r] = v2[r];
        v2[r] = v;
        i2[r] = b;
      } else if (v > v3[r]) {
        v3[r] = v;
      }
    }
    v2[r] = std::max(v2[r], 0.0);
    v3[r] = std::max(v3[r], 0.0);
  };

  for (int pass = 0; pass < kMicroSearchPasses && budget > 0; ++pass) {
    const std::vector<int> order = SortedBinOrder(bins);
    for (int r = 0; r < rows; ++r) {
      row_bins[r].assign(order.begin() + static_cast<size_t>(r) * w,
                         order.begin() + static_cast<size_t>(r + 1) * w);
      for (int b : row_bins[r]) row_of[b] = r;
      summarize(r);
    }
    // Targets outside the source row: every bin for small plans; for large ones only the bins
    // with the most room below their row's maximum, where moved cost is cheapest to absorb.
    std::vector<int> targets(num_bins);
    std::iota(targets.begin(), targets.end(), 0);
    if (num_bins > kMicroTargetBins) {
      auto headroom = [&](int b) { return v1[row_of[b]] - bins[b].cost; };
      std::nth_element(targets.begin(), targets.begin() + kMicroTargetBins, targets.end(),
                       [&](int x, int y) {
                         return headroom(x) > headroom(y) || (headroom(x) == headroom(y) && x < y);
                       });
      targets.resize(kMicroTargetBins);
    }
    bool improved = false;
    for (int r = 0; r < rows && budget > 0; ++r) {
      while (budget > 0) {
        const int a = i1[r];
        Bin& A = bins[a];
        if (A.sealed) break;
        const double ca = A.cost;
        const double s = v2[r];
        // When a ties with another bin for the row maximum, moving cost out of a changes nothing
        // yet but is progress: such neutral steps are taken when they create no new tie (the
        // number of bins at their row's maximum drops, so the search cannot cycle).
        const bool tied = ca - s <= tol;
        double best_delta = 0.0;
        double best_amount = 0.0;
        bool best_neutral = false;
        int best_b = -1;
        int best_x = -1;
        int best_y = -1;
        auto consider = [&](int b, double amount, int x, int y) {
          const int rb = row_of[b];
          const double nb = bins[b].cost + amount;
          double delta;
          double ceiling;  // the target must stay below this for a neutral step
          if (rb == r) {
            const double rest = (b == i2[r]) ? v3[r] : v2[r];
            delta = std::max({rest, ca - amount, nb}) - ca;
            ceiling = ca;
          } else {
            delta = std::max(s, ca - amount) - ca + std::max(v1[rb], nb) - v1[rb];
            ceiling = v1[rb];
          }
          if (delta < -tol) {
            if (best_b >= 0 && !best_neutral && delta >= best_delta) return;
            best_neutral = false;
          } else {
            if (!tied || amount <= tol || std::abs(delta) > tol || nb >= ceiling - tol) return;
            if (best_b >= 0 && (!best_neutral || amount <= best_amount)) return;
            best_neutral = true;
          }
          best_delta = delta;
          best_amount = amount;
          best_b = b;
          best_x = x;
          best_y = y;
        };
        for (size_t xi = 0; xi < A.items.size(); ++xi) {
          const int x = A.items[xi];
          const double cx = c[x];
          if (cx <= 0) continue;
          for (size_t t = 0; t < targets.size() + row_bins[r].size(); ++t) {
            const bool in_row = t >= targets.size();
            const int b = in_row ? row_bins[r][t - targets.size()] : targets[t];
            const Bin& B = bins[b];
            budget -= 1 + static_cast<int64_t>(B.items.size());
            if (b == a || B.sealed || (!in_row && row_of[b] == r)) continue;
            if (A.items.size() > 1 && B.tokens + len[x] <= cap) {
              consider(b, cx, static_cast<int>(xi), -1);
            }
            for (size_t yi = 0; yi < B.items.size(); ++yi) {
              const int y = B.items[yi];
              if (c[y] >= cx || B.tokens - len[y] + len[x] > cap ||
                  A.tokens - len[x] + len[y] > cap) {
                continue;
              }
              consider(b, cx - c[y], static_cast<int>(xi), static_cast<int>(yi));
            }
          }
        }
        if (best_b < 0) break;
        Bin& B = bins[best_b];
        const int x = A.items[best_x];
        A.items.erase(A.items.begin() + best_x);
        A.cost -= c[x];
        A.tokens -= len[x];
        if (best_y >= 0) {
          const int y = B.items[best_y];
          B.items.erase(B.items.begin() + best_y);
          B.cost -= c[y];
          B.tokens -= len[y];
          A.items.push_back(y);
          A.cost += c[y];
          A.tokens += len[y];
        }
        B.items.push_back(x);
        B.cost += c[x];
        B.tokens += len[x];
        summarize(r);
        if (row_of[best_b] != r) summarize(row_of[best_b]);
        improved = true;
      }
    }
    if (!improved) break;
  }
}

void SortByLengthDesc(std::vector<int>* items, const int64_t* len) {
  std::sort(items->begin(), items->end(),
            [len](int x, int y) { return len[x] > len[y] || (len[x] == len[y] && x < y); });
}

std::vector<std::vector<std::vector<int64_t>>> PlanMicro(const int64_t* len, const double* c, int n,
                                                         int w, int64_t cap) {
  std::vector<int> normal;
  std::vector<int> oversized;
  int64_t normal_tokens = 0;
  for (int i = 0; i < n; ++i) {
    if (len[i] > cap) {
      oversized.push_back(i);
    } else {
      normal.push_back(i);
      normal_tokens += len[i];
    }
  }
  auto by_cost_desc = [c, len](int x, int y) {
    if (c[x] != c[y]) return c[x] > c[y];
    if (len[x] != len[y]) return len[x] > len[y];
    return x < y;
  };
  std::sort(normal.begin(), normal.end(), by_cost_desc);
  std::sort(oversized.begin(), oversized.end(), by_cost_desc);

  const int64_t min_bins = static_cast<int64_t>(oversized.size()) + (normal_tokens + cap - 1) / cap;
  const int64_t min_rows = std::max<int64_t>(1, (min_bins + w - 1) / w);
  std::vector<int> all(n);
  std::iota(all.begin(), all.end(), 0);
  const Parts ffd = FirstFitDecreasing(all, len, c, cap);
  const int64_t ffd_rows = std::max<int64_t>(1, (static_cast<int64_t>(ffd.size()) + w - 1) / w);

  // The fewest microbatches per rank for which a cost-aware packing (balanced or row by row)
  // respects the cap. Both packings are refined by local search and the better one wins. FFD's
  // packing is the fallback that always respects the cap.
  std::vector<Bin> bins;
  std::vector<Bin> row_bins;
  bool have_balanced = false;
  bool have_rows = false;
  int64_t rows = min_rows;
  for (; rows <= ffd_rows; ++rows) {
    const int r = static_cast<int>(rows);
    have_balanced = PackBalanced(normal, oversized, len, c, cap, r * w, &bins);
    have_rows = w > 1 && PackRows(normal, oversized, len, c, cap, r, w, &row_bins);
    if (have_balanced || have_rows) break;
  }
  if (!have_balanced && !have_rows) {
    rows = ffd_rows;
    bins.assign(static_cast<size_t>(rows * w), Bin{});
    for (size_t b = 0; b < ffd.size(); ++b) {
      for (int x : ffd[b]) {
        bins[b].items.push_back(x);
        bins[b].cost += c[x];
        bins[b].tokens += len[x];
        bins[b].sealed = len[x] > cap;
      }
    }
    // Splitting a bin never breaks the cap: give every empty bin the cheapest sequence of the
    // fullest bin, so that microbatches are empty only when there are too few sequences.
    for (Bin& empty : bins) {
      if (!empty.items.empty()) continue;
      Bin* donor = &bins[0];
      for (Bin& bin : bins) {
        if (bin.items.size() > donor->items.size()) donor = &bin;
      }
      if (donor->items.size() < 2) break;
      auto it = std::min_element(donor->items.begin(), donor->items.end(), [c](int x, int y) {
        return c[x] < c[y] || (c[x] == c[y] && x < y);
      });
      const int x = *it;
      donor->items.erase(it);
      donor->cost -= c[x];
      donor->tokens -= len[x];
      empty.items.push_back(x);
      empty.cost = c[x];
      empty.tokens = len[x];
    }
    have_balanced = true;
  }
  if (w > 1) {
    if (have_balanced) ImproveRows(len, c, cap, w, &bins);
    if (have_rows) {
      ImproveRows(len, c, cap, w, &row_bins);
      if (!have_balanced || RowObjective(row_bins, w) < RowObjective(bins, w)) {
        bins = std::move(row_bins);
      }
    }
  }

  const std::vector<int> order = SortedBinOrder(bins);
  std::vector<std::vector<std::vector<int64_t>>> plan(w);
  std::vector<double> load(w, 0.0);
  std::vector<int> has_items(w, 0);
  std::vector<int> ranks(w);
  for (int64_t r = 0; r < rows; ++r) {
    const auto row_begin = order.begin() + r * w;
    if (bins[row_begin[0]].items.empty()) break;  // the remaining rows are all empty
    // Cheapest-so-far ranks take the row's largest bins; ranks without any sequence go first so
    // that every rank gets one whenever there are at least w sequences.
    std::iota(ranks.begin(), ranks.end(), 0);
    std::sort(ranks.begin(), ranks.end(), [&](int x, int y) {
      if (has_items[x] != has_items[y]) return has_items[x] < has_items[y];
      if (load[x] != load[y]) return load[x] < load[y];
      return x < y;
    });
    for (int t = 0; t < w; ++t) {
      Bin& bin = bins[row_begin[t]];
      const int rank = ranks[t];
      SortByLengthDesc(&bin.items, len);
      plan[rank].emplace_back(bin.items.begin(), bin.items.end());
      load[rank] += bin.cost;
      has_items[rank] |= bin.items.empty() ? 0 : 1;
    }
  }
  return plan;
}

// KK on the kKarmarkarKarpPerPart * k costliest items, then the rest, costliest first, each to
// the least loaded part. Returns item indices.
Parts PartitionMini(const double* c, int n, int k) {
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [c](int x, int y) { return c[x] > c[y]; });
  const int head =
      static_cast<int>(std::min<int64_t>(n, static_cast<int64_t>(kKarmarkarKarpPerPart) * k));
  std::vector<double> head_cost(head);
  for (int i = 0; i < head; ++i) head_cost[i] = c[order[i]];
  Parts parts = KarmarkarKarp(head_cost.data(), head, k);
  for (std::vector<int>& part : parts) {
    for (int& x : part) x = order[x];
  }
  if (head == n) return parts;
  using Load = std::pair<double, int>;
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> heap;
  for (int p = 0; p < k; ++p) {
    double load = 0.0;
    for (int x : parts[p]) load += c[x];
    heap.emplace(load, p);
  }
  for (int i = head; i < n; ++i) {
    auto [load, p] = heap.top();
    heap.pop();
    parts[p].push_back(order[i]);
    heap.emplace(load + c[order[i]], p);
  }
  return parts;
}

double MaxLoad(const double* c, const Parts& parts) {
  double out = 0.0;
  for (const std::vector<int>& part : parts) {
    double load = 0.0;
    for (int x : part) load += c[x];
    out = std::max(out, load);
  }
  return out;
}

// MULTIFIT (Coffman, Garey and Johnson): binary search on a capacity for which first-fit
// decreasing packs every item into k bins. It leaves a long item alone whenever nothing else fits
// beside it under the capacity, a structure that differencing and pairwise local search struggle
// to reach. Searches (lo, hi) and returns false if no capacity below hi worked.
bool MultiFit(const double* c, int n, int k, double lo, double hi, Parts* out) {
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [c](int x, int y) { return c[x] > c[y]; });
  Parts parts;
  auto pack = [&](double capacity) {
    FirstFit<double> ff(k, capacity);
    parts.assign(k, {});
    for (int x : order) {
      const int b = ff.Find(c[x]);
      if (b < 0) return false;
      ff.Take(b, c[x]);
      parts[b].push_back(x);
    }
    return true;
  };
  bool found = false;
  for (int iter = 0; iter < kMultiFitIterations && hi - lo > hi * kRelTol; ++iter) {
    const double mid = lo + (hi - lo) / 2;
    if (pack(mid)) {
      hi = mid;
      *out = parts;
      found = true;
    } else {
      lo = mid;
    }
  }
  return found;
}

std::vector<std::vector<std::vector<int64_t>>> PlanMini(const int64_t* len, const double* c, int n,
                                                        int w, int64_t cap) {
  Parts parts = PartitionMini(c, n, w);
  FillEmptyParts(c, &parts, n);
  ImprovePartition(c, &parts);
  const double best = MaxLoad(c, parts);
  double total = 0.0;
  double cmax = 0.0;
  for (int i = 0; i < n; ++i) {
    total += c[i];
    cmax = std::max(cmax, c[i]);
  }
  const double lower_bound = std::max(total / w, cmax);
  Parts alt;
  if (best > lower_bound * (1 + kMultiFitTrigger) && MultiFit(c, n, w, lower_bound, best, &alt)) {
    FillEmptyParts(c, &alt, n);
    ImprovePartition(c, &alt);
    if (MaxLoad(c, alt) < best) parts = std::move(alt);
  }
  std::vector<std::vector<std::vector<int64_t>>> plan(w);
  for (int r = 0; r < w; ++r) {
    for (const std::vector<int>& bin : FirstFitDecreasing(parts[r], len, c, cap)) {
      plan[r].emplace_back(bin.begin(), bin.end());
    }
  }
  return plan;
}

}  // namespace

Plan MakePlan(const int64_t* lengths, const double* costs, size_t n, int64_t world_size,
              int64_t max_tokens_per_microbatch, Mode mode) {
  Validate(lengths, costs, n, world_size, max_tokens_per_microbatch);
  const int num = static_cast<int>(n);
  const int w = static_cast<int>(world_size);
  const int64_t cap = max_tokens_per_microbatch;
  Plan plan;
  plan.microbatches = mode == Mode::kMini ? PlanMini(lengths, costs, num, w, cap)
                                          : PlanMicro(lengths, costs, num, w, cap);
  plan.rank_costs.assign(w, 0.0);
  for (int r = 0; r < w; ++r) {
    for (const auto& mb : plan.microbatches[r]) {
      for (int64_t x : mb) plan.rank_costs[r] += costs[x];
    }
  }
  std::vector<double> cost_vec(costs, costs + n);
  plan.makespan = ComputeMakespan(plan.microbatches, cost_vec, mode);
  double total = 0.0;
  double cmax = 0.0;
  for (size_t i = 0; i < n; ++i) {
    total += costs[i];
    cmax = std::max(cmax, costs[i]);
    if (lengths[i] > cap) plan.oversized.push_back(static_cast<int64_t>(i));
  }
  plan.lower_bound = std::max(total / w, cmax);
  return plan;
}

Plan MakePlan(const std::vector<int64_t>& lengths, const std::vector<double>& costs,
              int64_t world_size, int64_t max_tokens_per_microbatch, Mode mode) {
  if (lengths.size() != costs.size()) {
    throw std::invalid_argument("balance: lengths and costs differ in size");
  }
  return MakePlan(lengths.data(), costs.data(), lengths.size(), world_size,
                  max_tokens_per_microbatch, mode);
}

std::vector<std::vector<int64_t>> PartitionKarmarkarKarp(const std::vector<double>& costs,
                                                         int64_t parts) {
  if (parts < 1) throw std::invalid_argument("balance: parts must be >= 1");
  const Parts p =
      KarmarkarKarp(costs.data(), static_cast<int>(costs.size()), static_cast<int>(parts));
  std::vector<std::vector<int64_t>> out(p.size());
  for (size_t i = 0; i < p.size(); ++i) out[i].assign(p[i].begin(), p[i].end());
  return out;
}

int64_t RefineMaxLoad(const std::vector<double>& costs, std::vector<std::vector<int64_t>>* parts,
                      int64_t max_iterations) {
  Parts p(parts->size());
  for (size_t i = 0; i < parts->size(); ++i) {
    for (int64_t x : (*parts)[i]) p[i].push_back(static_cast<int>(x));
  }
  const int64_t steps = Refine(costs.data(), &p, max_iterations);
  for (size_t i = 0; i < p.size(); ++i) (*parts)[i].assign(p[i].begin(), p[i].end());
  return steps;
}

std::vector<std::vector<int64_t>> PackFirstFitDecreasing(const std::vector<int64_t>& items,
                                                         const std::vector<int64_t>& lengths,
                                                         const std::vector<double>& costs,
                                                         int64_t cap) {
  if (cap < 1) throw std::invalid_argument("balance: cap must be >= 1");
  const Parts bins = FirstFitDecreasing(std::vector<int>(items.begin(), items.end()),
                                        lengths.data(), costs.data(), cap);
  std::vector<std::vector<int64_t>> out(bins.size());
  for (size_t i = 0; i < bins.size(); ++i) out[i].assign(bins[i].begin(), bins[i].end());
  return out;
}

double ComputeMakespan(const std::vector<std::vector<std::vector<int64_t>>>& microbatches,
                       const std::vector<double>& costs, Mode mode) {
  if (mode == Mode::kMini) {
    double makespan = 0.0;
    for (const auto& rank : microbatches) {
      double total = 0.0;
      for (const auto& mb : rank) {
        for (int64_t x : mb) total += costs[x];
      }
      makespan = std::max(makespan, total);
    }
    return makespan;
  }
  std::vector<double> step_max;
  for (const auto& rank : microbatches) {
    if (rank.size() > step_max.size()) step_max.resize(rank.size(), 0.0);
    for (size_t m = 0; m < rank.size(); ++m) {
      double total = 0.0;
      for (int64_t x : rank[m]) total += costs[x];
      step_max[m] = std::max(step_max[m], total);
    }
  }
  return std::accumulate(step_max.begin(), step_max.end(), 0.0);
}

}  // namespace torch_odc::balance
