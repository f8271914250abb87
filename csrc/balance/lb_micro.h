// LB-Micro's planner (internal; planner.h's MakePlan dispatches to it): ranks synchronize after
// every microbatch, so all run the same number of microbatches and the makespan is the sum over
// microbatch index of the costliest rank's microbatch.
#pragma once

#include <cstdint>
#include <vector>

namespace torch_odc::balance::detail {

// Packs sequences 0..n-1 into rows of `w` microbatches of at most `cap` tokens (one per rank
// and microbatch index), minimizing the sum over rows of the row maximum. Returns
// microbatches[rank][m] = sequence indices. Inputs are validated by the caller.
std::vector<std::vector<std::vector<int64_t>>> PlanMicro(const int64_t* len, const double* c, int n,
                                                         int w, int64_t cap);

}  // namespace torch_odc::balance::detail
