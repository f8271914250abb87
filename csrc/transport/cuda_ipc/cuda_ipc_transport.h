// CUDA IPC transport for GPUs of one host.
//
// Each rank cudaMallocs one device region (shard caches, accumulators, epoch flags), exports it
// once with cudaIpcGetMemHandle, and opens every peer's handle once (cached until close). The
// barrier's control words live in a small host shared-memory region (ShmTransport), so the
// host barrier never touches device memory.
//
// Data path, all on the caller's stream, never a host round trip per call:
//  - publish: copy into the own cache, then a 1-thread kernel: system fence + st.release.sys.
//  - wait: a 1-thread kernel spinning with ld.acquire.sys on the peer's flag (deadline = the
//    process-group timeout; on expiry it records which wait failed in mapped host memory, and
//    the host raises at the next keyed call, Work::wait or the barrier).
//  - gather: one kernel over all peers: per block, one thread acquire-spins on the peer's flag
//    (deadline = the process-group timeout; on expiry it records which wait failed in mapped
//    host memory, and the host raises at the next keyed call, Work::wait or the barrier), then
//    the block copies its share with 16-byte loads over NVLink.
//  - push: one kernel over all owners: 16-byte loads and remote vector reductions into each
//    owner's accumulator.
// One launch per keyed op measured faster than per-peer copy-engine copies or per-peer kernels
// on side streams (benchmarks/probe_nvlink.cu, docs/benchmarks.md); those remain behind
// ODC_CUDA_FUSED=0 (waitFlag/read/accumulate below).
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/transport.h"
#include "transport/cuda_ipc/kernels.h"
#include "transport/shm/shm_transport.h"

namespace torch_odc {

class CudaIpcTransport : public Transport {
 public:
  CudaIpcTransport(int rank, int world, int device);
  ~CudaIpcTransport() override;

  const char* name() const override { return "cuda_ipc"; }
  void connect(Rendezvous& rdv, const std::string& prefix, const RegionLayout& layout,
               std::chrono::milliseconds timeout) override;
  void close() override;

  void writeLocal(size_t offset, const void* src, size_t bytes, Stream stream) override;
  void publish(size_t flag_offset, uint64_t value, Stream stream) override;
  void waitFlag(int peer, size_t flag_offset, uint64_t value, const WaitContext& ctx,
                Stream stream) override;
  void read(int peer, size_t offset, void* dst, size_t bytes, Stream stream) override;
  void accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset, const void* src,
                  size_t numel, DType dtype, double scale, Stream stream) override;
  double gatherPeers(size_t offset, size_t flag_offset, uint64_t value, size_t bytes,
                     const std::vector<PeerRead>& reads, Stream stream) override;
  void pushPeers(size_t accum_offset, size_t elem, size_t locks_offset, size_t numel, DType dtype,
                 double scale, const std::vector<PeerPush>& pushes, Stream stream) override;
  void endOp(Stream stream) override;
  void quiesce(Stream stream) override;

  void storeControl(size_t offset, uint64_t value) override;
  uint64_t loadControl(int peer, size_t offset) override;
  void* localPointer(size_t offset) override;
  void zeroLocal(size_t offset, size_t bytes, Stream stream) override;
  bool peerAlive(int peer) override;
  int deviceIndex() const override { return device_; }

  // Raises if a device-side wait gave up (called before every keyed op and in quiesce).
  void checkDeviceErrors();

 private:
  uint8_t* at(int peer, size_t offset) const;
  // The fp32 accumulator element `elem` of the key accumulator at `accum_offset` in `peer`.
  void* accumAt(int peer, size_t accum_offset, size_t elem, DType dtype);
  // The stream a peer's part of the current op runs on: its side stream, forked from `main`
  // at the op's first peer access, so reads from / pushes to different peers run concurrently.
  cudaStream_t peerStream(int peer, cudaStream_t main);

  const int rank_;
  const int world_;
  const int device_;
  int sm_count_ = 0;
  // Thread blocks per gather / push launch (over all peers): ODC_CUDA_CTAS, default 2 per SM.
  // ODC_CUDA_FUSED=0 falls back to per-peer copy-engine reads and per-peer push kernels.
  int ctas_ = 0;
  bool fused_ = true;
  std::chrono::milliseconds timeout_{0};
  size_t bytes_ = 0;
  std::vector<uint8_t*> bases_;  // device pointers; bases_[rank_] is the own cudaMalloc
  ShmTransport control_;
  cuda_ipc::DeviceError* error_host_ = nullptr;  // mapped pinned memory
  cuda_ipc::DeviceError* error_device_ = nullptr;
  // Descriptions of in-flight device waits, indexed by the slot a failing wait reports.
  static constexpr uint32_t kSlots = 4096;
  std::vector<std::function<std::string()>> wait_descriptions_;
  uint32_t next_slot_ = 0;
  std::mutex mu_;
  std::vector<cudaStream_t> side_;   // per peer
  std::vector<cudaEvent_t> joined_;  // per peer: end of its part of the current op
  std::vector<bool> side_used_;
  cudaEvent_t fork_ = nullptr;
  bool forked_ = false;
};

}  // namespace torch_odc
