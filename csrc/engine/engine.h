// The ODC engine: keys, epochs, shard-cache bookkeeping, push bookkeeping and the minibatch
// barrier protocol. It knows nothing about which transport moves the bytes.
//
// Epoch e is minibatch e (from 1). Within an epoch:
//  - gather(K): the first gather of K publishes this rank's shard (cache fill, then flag := e);
//    every gather reads each peer's shard after waiting for that peer's flag to reach e.
//  - push(K, params): adds chunk j of the input into rank j's accumulator of K, each parameter's
//    span at its own place (a push may cover any subset of K's trainable parameters), and marks
//    those parameters as pushed by this rank.
// Barrier of epoch e:
//  - arrive(): this rank's pushes are complete (quiesce); it reports its collectives count and
//    the bitmap of parameters it pushed (in the copy for e's parity), then arrived := e; wait
//    until every rank has arrived. After this no rank pushes into epoch e any more, so the
//    accumulators are final and may be read (finalize: FSDP2's sharded .grad becomes a view of
//    them), and the union of the bitmaps says which parameters got a gradient on some rank.
//    Ranks must also have run the same number of unkeyed collectives (checked here: a
//    collective in the microbatch loop hangs once ranks run different numbers of microbatches).
//  - release(): called when this rank enters minibatch e+1 (its first forward or keyed call, or
//    its next barrier), i.e. after its optimizer step and gradient clipping have read the
//    gradients: zero the accumulators (or the caller did, keeping what it must), then ready := e
//    (ordered on the stream after the zeroing), epoch := e + 1. Nobody waits here. A push in
//    epoch e+1 waits (on the device, for CUDA) until its owner's ready flag reached e: a fast
//    rank's next-minibatch pushes never land in an accumulator that its owner's optimizer step
//    still reads. Shard caches need no such wait: every read of epoch e was complete before
//    its reader arrived, hence before anyone passed arrive(e) and could republish.
// Gradient memory (freeAccumulators / restoreAccumulators): the accumulators are one allocation
// per generation, apart from the region, so that a trainer that holds no gradients between
// minibatches (RL generation after zero_grad()) holds no accumulators either:
//  - free (every rank, when no rank has pushed in the current minibatch: after the barrier and
//    the optimizer step, or before the first backward): quiesce, unmap every peer's
//    accumulators, closed := gen, wait until every rank's closed reached gen (nobody maps ours
//    any more), drop the own reference. The memory is freed once no gradient view pins it.
//  - restore (every rank; explicitly, or at its first push or arrival of a minibatch): allocate
//    generation gen + 1 zeroed, describe it in the control words, gen := gen + 1, wait until
//    every rank's gen reached it, map every peer's, then opened := gen and wait for every
//    rank's (a transport may then forget names). A push or arrival never runs on freed memory.
// Why no wait deadlocks: a gather in epoch e waits only for a peer's publish in epoch e, which
// the peer makes at its first gather of the key or, at the latest, before it arrives at the
// barrier (the caller publishes every unpublished key first, in key order); a push waits only
// for its owner's release, which the owner makes before its next gather, push or arrival, and
// after nothing but local work; barrier waits need every rank to call the barrier. A rank that
// never does makes its peers time out with an error naming it.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/layout.h"
#include "engine/transport.h"

namespace torch_odc {

struct EngineStats {
  uint64_t keyed_gathers = 0;
  uint64_t keyed_reduce_scatters = 0;
  uint64_t publishes = 0;
  uint64_t bytes_fetched = 0;
  uint64_t bytes_pushed = 0;
  double publish_wait_s = 0;  // time spent waiting for peers' publishes
  double barrier_s = 0;       // time inside the minibatch barrier
  // Host time the barrier only waited: for this rank's device work, then for the peers.
  double barrier_wait_s = 0;
  uint64_t minibatches = 0;

  void add(const EngineStats& o);
};

// Where free_gradient_memory / restore_gradient_memory spend their host time, summed over the
// calls that did something (seconds).
struct GradientMemoryTimes {
  uint64_t frees = 0;
  uint64_t restores = 0;
  double free_s = 0;          // the whole free
  double free_wait_s = 0;     // of which waiting for every peer to close ours
  double allocate_s = 0;      // restore: allocating (and zeroing) the new generation
  double open_s = 0;          // restore: mapping every peer's
  double restore_wait_s = 0;  // restore: waiting for every peer to allocate, then to map
  double restore_s = 0;       // the whole restore
};

class Engine {
 public:
  Engine(int rank, int world, std::chrono::milliseconds timeout,
         std::unique_ptr<Transport> transport);
  ~Engine();

  // Collective: checks that every rank registers the same keys, then connects the transport.
  void connect(Rendezvous& rdv, const std::string& prefix, std::vector<KeySpec> keys);
  void close();

  int rank() const { return rank_; }
  int world() const { return world_; }
  uint64_t epoch() const { return epoch_; }
  const RegionLayout& layout() const { return layout_; }
  Transport& transport() { return *transport_; }
  size_t keyIndex(const std::string& name) const;
  // The name of a keyed operation on `key` ("odc::gather <key name>", ...), made once at
  // connect: profiler and NVTX ranges name every call without building a string per call.
  enum class Op { kGather = 0, kPublish = 1, kPush = 2 };
  const std::string& opName(Op op, size_t key) const {
    return op_names_.at(key)[static_cast<size_t>(op)];
  }

  // Keyed all-gather: `in` is this rank's shard (in_bytes), `out` receives world shards.
  void gather(size_t key, void* out, const void* in, size_t in_bytes, size_t out_bytes, DType dtype,
              Stream stream);
  // Publishes `in` for `key` if not yet published in this epoch; reads nothing.
  void publish(size_t key, const void* in, size_t in_bytes, DType dtype, Stream stream);
  // Publishes, in one operation, every key of `keys` not yet published in this epoch: `fill` is
  // called once with those keys and their caches (host pointers on the CPU, device pointers for
  // CUDA) and must make each one hold its shard (cacheBytes(), in the cache dtype) on `stream`,
  // writing nothing where it holds it already (parameters that live in the cache); then every
  // flag is released after the fill, on `stream`. Reads nothing, waits for nobody.
  // `fill` runs under the engine's lock: it must not call the engine. Returns the keys published.
  using Fill =
      std::function<void(const std::vector<size_t>& keys, const std::vector<void*>& caches)>;
  std::vector<size_t> publishWith(const std::vector<size_t>& keys, const Fill& fill, Stream stream);
  // Keyed reduce-scatter: `in` holds world chunks, each the concatenation of the (padded) shards
  // of `params` (indices into the key's parameters, in the input's order; empty: every trainable
  // parameter in key order). Adds scale * each parameter's shard in chunk j into its span of rank
  // j's accumulator of `key`.
  void push(size_t key, const void* in, size_t in_numel, DType dtype, double scale,
            const std::vector<uint32_t>& params, Stream stream);
  // A collective outside keyed calls (counted; compared across ranks at the barrier).
  void noteCollective(const std::string& op);

  bool publishedThisEpoch(size_t key) const;
  // Barrier phase 1 (see above). After it, gradParams/accumulator describe final sums.
  // `trace`, if given, is called around the two waits inside (phase kArriveWaitDevice: this
  // rank's own device work; kArriveWaitPeers: every peer's arrival), begin true then false.
  enum class Phase { kArriveWaitDevice, kArriveWaitPeers };
  void arrive(Stream stream, const std::function<void(Phase, bool)>& trace = {});
  // Per parameter of `key`: whether some rank pushed a gradient for it in this minibatch.
  std::vector<bool> gradParams(size_t key);
  void* accumulator(size_t key);
  // Barrier phase 2 (see above): zero every accumulator if `zero` (else the caller zeroed what
  // it must on `stream`), publish ready := epoch on `stream`, advance the epoch. Waits for nobody.
  void release(Stream stream, bool zero = true);
  // Whether arrive() ran and release() has not yet (the gradients of this epoch are final).
  bool arrived() const;
  // Gradient memory (see above). Collective; free refuses once this rank pushed in the current
  // minibatch. Both are no-ops when the accumulators already are as asked.
  void freeAccumulators(Stream stream);
  void restoreAccumulators();
  bool accumulatorsResident() const;
  // The generation of the own accumulators (views made of an older one are stale).
  uint64_t accumulatorGeneration() const;
  GradientMemoryTimes gradientMemoryTimes() const;
  // Called once before retrying an accumulator allocation that failed (e.g. to return the
  // memory a caching allocator holds).
  void setAllocationRetry(std::function<void()> retry) { alloc_retry_ = std::move(retry); }

  EngineStats lastStats() const;
  EngineStats totalStats() const;
  EngineStats currentStats() const;

 private:
  std::string where(size_t key) const;
  void checkKey(size_t key, const char* op) const;
  void publishLocked(size_t key, const void* in, size_t in_bytes, DType dtype, Stream stream);
  void waitAll(size_t control_offset, const char* phase, bool check_collectives);
  std::string collectivesMismatch(int peer, uint64_t mine, uint64_t theirs) const;
  void waitOwnersReady(size_t key, Stream stream);
  void freeLocked(Stream stream);
  void restoreLocked();
  // Waits until every peer's control word at `offset` is >= value; `what` completes "peer rank
  // N to ..." in the error.
  void waitWord(size_t offset, uint64_t value, const std::string& what);
  WaitContext context(std::function<std::string()> describe) const;

  const int rank_;
  const int world_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<Transport> transport_;
  RegionLayout layout_;
  bool connected_ = false;
  bool arrived_ = false;
  uint64_t epoch_ = 1;
  std::vector<std::array<std::string, 3>> op_names_;  // per key, by Op
  std::vector<uint64_t> published_;  // epoch in which this rank last published each key
  // Per key: the epoch and stream of the last gather that waited for every peer's publish. A
  // later gather of the key in that epoch on that stream needs no wait (Transport::PeerRead).
  std::vector<uint64_t> gather_waited_;
  std::vector<Stream> gather_stream_;
  std::vector<uint64_t> pushed_bits_;  // parameters this rank pushed in this epoch (bitmap)
  uint64_t accum_gen_ = 0;             // generation of the own accumulators
  bool accum_resident_ = false;        // they are allocated and every peer's is mapped
  std::function<void()> alloc_retry_;
  GradientMemoryTimes gm_times_;
  // Per key: its trainable parameters in key order, and their spans merged into runs (what a
  // push of every trainable parameter, the common case, uses without building them per call).
  struct Run {
    size_t dst, src, numel;  // accumulator element offset, input chunk offset, elements
  };
  std::vector<std::vector<uint32_t>> all_params_;
  std::vector<std::vector<Run>> all_runs_;
  std::vector<size_t> all_chunk_;  // elements of one rank's chunk of such a push
  // Scratch reused by every call (no allocation per keyed call once warm).
  std::vector<Transport::PeerRead> reads_;
  std::vector<Transport::PeerPush> pushes_;
  std::vector<Run> runs_;
  std::vector<uint8_t> seen_;
  uint64_t ready_waited_ = 0;        // the epoch whose pushes waited for the owners' release
  Stream ready_stream_ = nullptr;    // ... on this stream
  std::vector<uint64_t> peer_bits_;  // union over all ranks, valid between arrive and release
  std::atomic<uint64_t> collectives_{0};
  mutable std::mutex op_mu_;
  std::string last_collective_;  // guarded by op_mu_
  mutable std::mutex mu_;
  EngineStats current_, last_, total_;
};

}  // namespace torch_odc
