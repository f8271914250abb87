// LB-Mini's planner (internal; planner.h's MakePlan dispatches to it): ranks synchronize once
// per minibatch, so only each rank's total cost matters.
#pragma once

#include <cstdint>
#include <vector>

namespace torch_odc::balance::detail {

// Splits sequences 0..n-1 over `w` ranks to minimize the largest rank cost, then packs each
// rank's share into microbatches of at most `cap` tokens. Returns microbatches[rank][m] =
// sequence indices. Inputs are validated by the caller.
std::vector<std::vector<std::vector<int64_t>>> PlanMini(const int64_t* len, const double* c, int n,
                                                        int w, int64_t cap);

}  // namespace torch_odc::balance::detail
