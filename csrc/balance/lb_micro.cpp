// LB-Micro's planner: ranks synchronize after every microbatch, so the plan minimizes the sum
// over microbatch index of the costliest rank's microbatch. Cost-balanced and row-by-row packing
// into the fewest rows the token cap allows (first-fit decreasing as the fallback), local search
// on the sum of row maxima, and the assignment of each row's bins to ranks.
#include "balance/lb_micro.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <queue>
#include <set>
#include <utility>
#include <vector>

#include "balance/packing.h"

namespace torch_odc::balance::detail {
namespace {

// Upper bounds on local-search work; they make planning time predictable for large inputs.
constexpr int64_t kMicroSearchBudget = 1'500'000;  // (bin, sequence) pairs examined
constexpr int kMicroSearchPasses = 16;
constexpr int kMicroTargetBins = 256;

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

}  // namespace

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

}  // namespace torch_odc::balance::detail
