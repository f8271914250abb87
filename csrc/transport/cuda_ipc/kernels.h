// Device-side pieces of the CUDA IPC transport: publish (release store of an epoch flag), wait
// (acquire spin on a peer's flag with a deadline), push-accumulate (remote reductions over
// NVLink). Launch wrappers are host functions; everything runs on the given stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "engine/types.h"

namespace torch_odc::cuda_ipc {

// Mapped pinned host memory shared by the host and every ODC kernel of one rank.
struct DeviceError {
  uint32_t flag;   // 0 = no error; set by a wait that reached its deadline
  uint32_t slot;   // which wait (index into the host's description ring)
  uint32_t abort;  // set by the host (watchdog, close): every wait returns, every copy is skipped
  uint32_t pad;
  uint64_t clock;  // %globaltimer read by launchReadClock (host/device clock calibration)
};

// Writes the device's %globaltimer (ns) into error->clock.
void launchReadClock(DeviceError* error, cudaStream_t stream);
// Nonzero (a CUDA error) if this build has no kernel image for `device`.
cudaError_t kernelImageProblem(int device);

void launchPublish(uint64_t* flag, uint64_t value, cudaStream_t stream);
// launchPublish of `count` flags `stride` bytes apart from `first`, in one one-block launch.
void launchPublishFlags(uint8_t* first, size_t count, size_t stride, uint64_t value,
                        cudaStream_t stream);
// Deadlines are absolute, in the device's %globaltimer nanoseconds: one per operation, computed
// on the host when it is enqueued, so queued waits never extend it. A wait also returns at once
// when any wait of this rank has failed or the host set `abort`.
//
// `stop` is one word in this rank's device memory, zero while all is well. Only the one-block
// wait kernel reads the host words of `error` (one thread); when its wait expires or it sees a
// failure or the host's abort, it sets `stop`, and every copy and push kernel skips its blocks
// while `stop` is set: a copy or push behind a failed wait never runs (its data is never used:
// the host raises first). The host also sets `stop` at abort, for work queued behind waits that
// already completed. No multi-block kernel reads mapped host memory (each such read serializes
// over PCIe: 0.3-0.6 ms per launch on an H100).
// The per-peer operations of ODC_CUDA_FUSED=0: the kernels below with a single entry.
void launchWait(const uint64_t* peer_flag, uint64_t value, uint64_t deadline_ns, DeviceError* error,
                uint32_t* stop, uint32_t slot, cudaStream_t stream);
// Copies `bytes` from a peer's region (the gather copy kernel, one entry), unless a wait failed.
void launchRead(void* dst, const void* src, size_t bytes, const uint32_t* stop, int ctas,
                cudaStream_t stream);
// launchRead of `numel` elements of `from` as `to`: a copy, or fp32 rounded to bf16/fp16.
void launchReadAs(void* dst, const void* src, size_t numel, DType from, DType to,
                  const uint32_t* stop, int ctas, cudaStream_t stream);
// The fp32 accumulator dst[i] += scale * src[i] for i < numel (src fp32, bf16 or fp16, widened
// in registers), with remote reductions.
void launchPush(void* dst, const void* src, size_t numel, DType dtype, float scale,
                const uint32_t* stop, int sm_count, cudaStream_t stream);

// One keyed operation over several peers in one launch (blockIdx.y = entry). Up to kMaxPeers
// entries (GPUs of one host).
constexpr int kMaxPeers = 16;  // <= 32: one waiting thread per entry
struct GatherArgs {
  const uint8_t* src[kMaxPeers];    // the peer's shard cache (mapped)
  uint8_t* dst[kMaxPeers];          // the peer's chunk of the output
  const uint64_t* flag[kMaxPeers];  // the peer's published flag (mapped)
  uint32_t slot[kMaxPeers];         // description slot reported if this wait times out
  int count = 0;
};
struct PushArgs {
  void* dst[kMaxPeers];        // the owner's fp32 accumulator span (mapped, or own)
  const void* src[kMaxPeers];  // the local chunk for that owner
  int count = 0;
};
// A one-block kernel acquire-spins on every flag[y] >= value (until deadline_ns; on expiry
// records slot[y] in `error`), then (numel > 0) one kernel copies every entry's `numel`
// elements with 16-byte loads from the peers (8 in flight per thread), rounding fp32 to `to`
// where `from` is fp32 and `to` bf16/fp16, or nothing once a wait failed or abort is set.
// wait=false: the copy only (every flag was already waited for earlier on this stream).
void launchGather(const GatherArgs& args, size_t numel, DType from, DType to, uint64_t value,
                  uint64_t deadline_ns, DeviceError* error, uint32_t* stop, int ctas, bool wait,
                  cudaStream_t stream);
// How a push adds into the accumulators. kElement: every thread issues 16-byte vector reductions
// (red.v4.f32). kBulk (sm_90 only; spans 16-byte aligned and of at least one 4096-element tile,
// otherwise kElement): blocks widen tiles into shared memory and cp.reduce.async.bulk adds each
// tile (measured 5% faster for fp32 sources and 21% for bf16 at 256 MiB on an H100,
// docs/benchmarks.md).
enum class PushMode { kElement, kBulk };
// dst[y][i] += scale * src[y][i] into fp32 accumulators, each element added atomically (16-bit
// sources are widened first, so they move twice their bytes), by `mode`.
void launchPushAll(const PushArgs& args, size_t numel, DType dtype, float scale,
                   const uint32_t* stop, int ctas, PushMode mode, cudaStream_t stream);

}  // namespace torch_odc::cuda_ipc
