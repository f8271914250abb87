// What the engine needs from a transport. The engine decides *what* moves *where* (offsets in
// the region layout, epochs, order); a transport decides *how* (memcpy over shared memory, copy
// engines and kernels over CUDA IPC). Data-path calls take a Stream: a transport may run them
// asynchronously on it, provided it preserves their order on that stream.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/layout.h"
#include "engine/rendezvous.h"
#include "engine/types.h"

namespace torch_odc {

// What a wait needs to fail well: when to give up, and how to say what was awaited.
struct WaitContext {
  Clock::time_point deadline;
  std::function<std::string()> describe;  // e.g. "peer rank 3 to publish key 'layers.0' ..."
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;

  // Collective over the group: create this rank's region with `layout`, export it through
  // `rdv` under `prefix`, import every peer's. Regions start zeroed.
  virtual void connect(Rendezvous& rdv, const std::string& prefix, const RegionLayout& layout,
                       std::chrono::milliseconds timeout) = 0;
  // Unmaps everything; idempotent. The own region's memory outlives close() while a pin of it
  // (pinLocal) is held.
  virtual void close() = 0;
  // A reference that keeps the own region's memory allocated (not its mapping by peers) after
  // close(), for tensors that view it (the sharded parameters a shard cache holds); null if the
  // transport cannot.
  virtual std::shared_ptr<void> pinLocal() { return nullptr; }

  // ---- the accumulators: one allocation per generation, addressed by the offsets from
  // layout.accumBegin() on (engine.h, "Gradient memory"); connect() maps none ----
  // Allocates this rank's accumulators of generation `gen` (accumRegionBytes(), zeroed, the
  // zeroing complete on return) and returns what a peer needs to map them (at most
  // RegionLayout::kAccumBlobBytes bytes).
  virtual std::string createAccumulators(uint64_t gen) = 0;
  // Maps peer `peer`'s accumulators from the blob its createAccumulators returned.
  virtual void openAccumulators(int peer, const std::string& blob) = 0;
  // Unmaps every peer's accumulators (nothing of this rank may still be pushing into them).
  virtual void closePeerAccumulators() = 0;
  // Drops this rank's reference to its own accumulators (after every peer closed them): their
  // memory is freed once no pin (pinAccumulators) holds it.
  virtual void dropAccumulators() = 0;
  // Every rank has mapped every rank's accumulators of the current generation.
  virtual void accumulatorsOpened() {}
  // Like pinLocal(), for the own accumulators of the current generation (the gradient views).
  virtual std::shared_ptr<void> pinAccumulators() { return nullptr; }

  // ---- data path (ordered on `stream`) ----
  // Copies local memory into the own region (the shard cache fill).
  virtual void writeLocal(size_t offset, const void* src, size_t bytes, Stream stream) = 0;
  // Makes the preceding writes visible, then stores `value` into the own flag at `offset`.
  virtual void publish(size_t flag_offset, uint64_t value, Stream stream) = 0;
  // publish() of `count` flags `stride` bytes apart from `first_offset`, after the preceding
  // writes (one operation: the CUDA transport launches one kernel for all of them).
  virtual void publishFlags(size_t first_offset, size_t count, size_t stride, uint64_t value,
                            Stream stream) {
    for (size_t i = 0; i < count; ++i) publish(first_offset + i * stride, value, stream);
  }
  // Waits until the peer's flag at `offset` is >= value, ordering later reads after it.
  virtual void waitFlag(int peer, size_t flag_offset, uint64_t value, const WaitContext& ctx,
                        Stream stream) = 0;
  // One-sided read from a peer's region.
  virtual void read(int peer, size_t offset, void* dst, size_t bytes, Stream stream) = 0;
  // read() of `numel` elements of `from` as `to`: a copy when they are equal, else fp32 rounded
  // to bf16/fp16 exactly as torch rounds (KeySpec::servable).
  virtual void readAs(int peer, size_t offset, void* dst, size_t numel, DType from, DType to,
                      Stream stream) {
    if (from != to) {
      throw OdcError(std::string("odc: the ") + name() + " transport cannot read " +
                     dtypeName(from) + " as " + dtypeName(to));
    }
    read(peer, offset, dst, numel * elementSize(from), stream);
  }
  // One-sided accumulate: acc[elem + i] += scale * src[i] for i < numel, where acc is the peer's
  // accumulator at `accum_offset`, in accumDtypeFor(dtype) (16-bit sources are widened to fp32
  // before the add). Safe under concurrent pushers into the same accumulator: `locks_offset`
  // addresses the key's lock words, one per kLockBlockElems accumulator elements counted from
  // `accum_offset`, for transports that need locks. Read by the owner only after the barrier.
  // `epoch` (the minibatch) is for error messages.
  virtual void accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset,
                          uint64_t epoch, const void* src, size_t numel, DType dtype, double scale,
                          Stream stream) = 0;
  // One keyed gather's peer part: for each entry, wait until the peer's flag at `flag_offset`
  // is >= value, then read `numel` elements of `from` (0: only wait) from the peer's region at
  // `offset` into `dst` as `to` (readAs).
  // Returns the host seconds spent waiting (0 where the waits run on a device). The default runs
  // the entries one after the other through waitFlag + read; a transport may run them as one
  // operation (the CUDA transport: one kernel over every peer).
  // `ready_known`: a wait for this flag and value was already issued on `stream` (flags only grow
  // within a minibatch), so the read needs no wait of its own: stream order puts it behind that
  // wait, and a wait that failed stops every read behind it (the CUDA transport's stop word).
  struct PeerRead {
    int peer;
    void* dst;
    WaitContext ctx;
    bool ready_known = false;
  };
  virtual double gatherPeers(size_t offset, size_t flag_offset, uint64_t value, size_t numel,
                             DType from, DType to, const std::vector<PeerRead>& reads,
                             Stream stream) {
    double waited = 0;
    for (const auto& r : reads) {
      if (!r.ready_known) {
        const auto t0 = Clock::now();
        waitFlag(r.peer, flag_offset, value, r.ctx, stream);
        waited += std::chrono::duration<double>(Clock::now() - t0).count();
      }
      if (numel > 0) readAs(r.peer, offset, r.dst, numel, from, to, stream);
    }
    return waited;
  }
  // One keyed reduce-scatter: accumulate() into every listed owner (the own rank included).
  struct PeerPush {
    int peer;
    const void* src;
  };
  virtual void pushPeers(size_t accum_offset, size_t elem, size_t locks_offset, uint64_t epoch,
                         size_t numel, DType dtype, double scale,
                         const std::vector<PeerPush>& pushes, Stream stream) {
    for (const auto& p : pushes) {
      accumulate(p.peer, accum_offset, elem, locks_offset, epoch, p.src, numel, dtype, scale,
                 stream);
    }
  }
  // Ends one keyed operation: whatever the transport ran beside `stream` (e.g. one side stream
  // per peer) is joined back into it, so later work on `stream` sees the whole operation.
  virtual void endOp(Stream /*stream*/) {}
  // Returns once every data-path operation issued on `stream` has completed everywhere.
  virtual void quiesce(Stream stream) = 0;
  // Makes every pending wait give up at once (process-group abort, shutdown); the data behind
  // such a wait is never used. Host transports wait synchronously and need nothing here.
  virtual void abort() {}
  // Raises an error a device-side wait or a watchdog recorded (sticky), before any further op.
  // Host transports raise at the failing call itself and need nothing here.
  virtual void checkErrors() {}

  // ---- host control (barrier words; always host-visible) ----
  virtual void storeControl(size_t offset, uint64_t value) = 0;  // own region, release
  virtual uint64_t loadControl(int peer, size_t offset) = 0;     // acquire
  // Host pointer to the own region at `offset` (for CPU; device pointer for device transports).
  virtual void* localPointer(size_t offset) = 0;
  virtual void zeroLocal(size_t offset, size_t bytes, Stream stream) = 0;
  // False once the peer process is known to be gone.
  virtual bool peerAlive(int peer) = 0;
  // The CUDA device the region lives on, or -1 for host memory.
  virtual int deviceIndex() const { return -1; }
  // The bytes it allocates for a region or accumulators of `bytes` (more where it rounds up):
  // what stats() reports this rank holds.
  virtual size_t allocationBytes(size_t bytes) const { return bytes; }
};

}  // namespace torch_odc
