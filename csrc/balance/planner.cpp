// The balance planner's public entry point (planner.h): input validation, the dispatch of
// MakePlan to LB-Mini (lb_mini.cpp) or LB-Micro (lb_micro.cpp), the plan's summary figures, and
// the makespan of either mode. The shared packing machinery and the public building blocks that
// wrap it live in packing.cpp.
#include "balance/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "balance/lb_micro.h"
#include "balance/lb_mini.h"

namespace torch_odc::balance {
namespace {

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

}  // namespace

Plan MakePlan(const int64_t* lengths, const double* costs, size_t n, int64_t world_size,
              int64_t max_tokens_per_microbatch, Mode mode) {
  Validate(lengths, costs, n, world_size, max_tokens_per_microbatch);
  const int num = static_cast<int>(n);
  const int w = static_cast<int>(world_size);
  const int64_t cap = max_tokens_per_microbatch;
  Plan plan;
  plan.microbatches = mode == Mode::kMini ? detail::PlanMini(lengths, costs, num, w, cap)
                                          : detail::PlanMicro(lengths, costs, num, w, cap);
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
