// Load-balancing planner for on-demand training (torch-independent).
//
// Splits a minibatch of sequences over `world_size` ranks and each rank's share into
// microbatches whose token count respects a cap. Two synchronization models:
//   * kMini  (LB-Mini):  ranks synchronize once per minibatch, so only each rank's total cost
//                        matters. makespan = max over ranks of the rank's total cost.
//   * kMicro (LB-Micro): ranks synchronize after every microbatch (collective FSDP), so all
//                        ranks run the same number of microbatches and
//                        makespan = sum over microbatch index of the max over ranks.
// Costs are arbitrary non-negative doubles (one per sequence); lengths are token counts.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace torch_odc::balance {

enum class Mode { kMini, kMicro };

struct Plan {
  // microbatches[r][m] holds the sequence indices of rank r's m-th microbatch.
  std::vector<std::vector<std::vector<int64_t>>> microbatches;
  std::vector<double> rank_costs;
  double makespan = 0.0;
  // max(total cost / world_size, largest single cost): no plan in either mode can beat it.
  double lower_bound = 0.0;
  // Indices of sequences longer than the token cap; each sits alone in its microbatch.
  std::vector<int64_t> oversized;
};

// Plans one minibatch. Throws std::invalid_argument on empty input, a non-positive length,
// a negative or non-finite cost, world_size < 1 or max_tokens_per_microbatch < 1.
Plan MakePlan(const int64_t* lengths, const double* costs, size_t n, int64_t world_size,
              int64_t max_tokens_per_microbatch, Mode mode);
Plan MakePlan(const std::vector<int64_t>& lengths, const std::vector<double>& costs,
              int64_t world_size, int64_t max_tokens_per_microbatch, Mode mode);

// Building blocks, exposed for tests and benchmarks.

// Multi-way Karmarkar-Karp largest differencing: splits items 0..n-1 into `parts` subsets.
std::vector<std::vector<int64_t>> PartitionKarmarkarKarp(const std::vector<double>& costs,
                                                         int64_t parts);

// Local search on a partition: moves and swaps between the most loaded part and any other part
// while that lowers the larger of the two loads, for at most `max_iterations` steps. Never
// empties a part. Returns the number of improving steps taken.
int64_t RefineMaxLoad(const std::vector<double>& costs, std::vector<std::vector<int64_t>>* parts,
                      int64_t max_iterations);

// First-fit decreasing by length: packs `items` into bins of at most `cap` tokens (an item
// longer than `cap` gets a bin of its own). Bins come out ordered by total cost, descending;
// items inside a bin by length, descending.
std::vector<std::vector<int64_t>> PackFirstFitDecreasing(const std::vector<int64_t>& items,
                                                         const std::vector<int64_t>& lengths,
                                                         const std::vector<double>& costs,
                                                         int64_t cap);

// Makespan of `microbatches` under `mode` (see Mode). In kMicro, ranks with fewer microbatches
// count as idle at the missing indices.
double ComputeMakespan(const std::vector<std::vector<std::vector<int64_t>>>& microbatches,
                       const std::vector<double>& costs, Mode mode);

}  // namespace torch_odc::balance
