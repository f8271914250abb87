// LB-Mini's planner: ranks synchronize once per minibatch, so the plan minimizes the largest
// rank cost. Karmarkar-Karp on the costliest sequences plus a greedy tail, local search (moves,
// swaps, exhaustive pair re-splits), MULTIFIT as an alternative start, and first-fit decreasing
// of each rank's share into microbatches under the token cap.
#include "balance/lb_mini.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <queue>
#include <utility>
#include <vector>

#include "balance/packing.h"

namespace torch_odc::balance::detail {
namespace {

// Upper bounds on local-search work; they make planning time predictable for large inputs.
constexpr int64_t kMiniRefineSteps = 2048;
constexpr int kMiniRounds = 3;
constexpr int kPairMaxUnion = 12;           // 2^11 splits per pair
constexpr int64_t kPairBudget = 4'000'000;  // subset sums visited, over all pair steps
// LB-Mini also tries MULTIFIT when KK and local search end this far above the lower bound.
constexpr double kMultiFitTrigger = 1e-3;
constexpr int kMultiFitIterations = 24;
// Beyond this many sequences per rank, KK runs on the largest ones and the rest are added
// greedily: the small tail only fills gaps, and full KK on 64-tuples would dominate the time.
constexpr int kKarmarkarKarpPerPart = 16;

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

}  // namespace

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

}  // namespace torch_odc::balance::detail
