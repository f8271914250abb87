// Shared packing machinery of the balance planner: Karmarkar-Karp largest differencing, the
// max-load local search and first-fit decreasing (see packing.h), and the public building blocks
// of planner.h that wrap them.
#include "balance/packing.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <utility>
#include <vector>

#include "balance/planner.h"

namespace torch_odc::balance {
namespace detail {

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

// ---- first-fit decreasing ------------------------------------------------------------------

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

}  // namespace detail

using detail::Parts;

std::vector<std::vector<int64_t>> PartitionKarmarkarKarp(const std::vector<double>& costs,
                                                         int64_t parts) {
  if (parts < 1) throw std::invalid_argument("balance: parts must be >= 1");
  const Parts p =
      detail::KarmarkarKarp(costs.data(), static_cast<int>(costs.size()), static_cast<int>(parts));
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
  const int64_t steps = detail::Refine(costs.data(), &p, max_iterations);
  for (size_t i = 0; i < p.size(); ++i) (*parts)[i].assign(p[i].begin(), p[i].end());
  return steps;
}

std::vector<std::vector<int64_t>> PackFirstFitDecreasing(const std::vector<int64_t>& items,
                                                         const std::vector<int64_t>& lengths,
                                                         const std::vector<double>& costs,
                                                         int64_t cap) {
  if (cap < 1) throw std::invalid_argument("balance: cap must be >= 1");
  const Parts bins = detail::FirstFitDecreasing(std::vector<int>(items.begin(), items.end()),
                                                lengths.data(), costs.data(), cap);
  std::vector<std::vector<int64_t>> out(bins.size());
  for (size_t i = 0; i < bins.size(); ++i) out[i].assign(bins[i].begin(), bins[i].end());
  return out;
}

}  // namespace torch_odc::balance
