// CUDA IPC transport for GPUs of one host.
//
// Each rank cudaMallocs one device region (shard caches, epoch flags), exports it once with
// cudaIpcGetMemHandle, and opens every peer's handle once (cached until close). Its gradient
// accumulators are a cudaMalloc of their own per generation, exported and opened alike, closed
// and freed by free_gradient_memory() (engine.h, "Gradient memory"). The
// barrier's control words live in a small host shared-memory region (ShmTransport), so the
// host barrier never touches device memory.
//
// Data path, all on the caller's stream, never a host round trip per call:
//  - publish: copy into the own cache, then a 1-thread kernel: system fence + st.release.sys.
//  - wait: a 1-thread kernel spinning with ld.acquire.sys on the peer's flag (deadline = the
//    process-group timeout; on expiry it records which wait failed in mapped host memory, and
//    the host raises at the next keyed call, Work::wait or the barrier).
//  - gather: a one-block kernel in which one thread per peer acquire-spins on the peer's flag
//    (deadline = the process-group timeout; on expiry it records which wait failed in mapped
//    host memory, and the host raises at the next keyed call, Work::wait or the barrier), then
//    one kernel over all peers copies with 16-byte loads over NVLink. A key's later gathers in
//    the same minibatch on the same stream launch the copy only (PeerRead::ready_known).
//  - push: one kernel over all owners: on sm_90 tiles widened into shared memory and added into
//    each owner's accumulator by bulk reductions (cp.reduce.async.bulk), elsewhere 16-byte
//    loads and remote vector reductions.
// Failures end in seconds, however many ops are queued: every wait of an op compares against
// the op's absolute deadline (host deadline + a host-to-%globaltimer offset calibrated at connect
// and at every barrier) and polls an abort word in mapped host memory; once one wait failed or
// the abort word is set, every queued and later wait returns at once and the copies and pushes
// behind them are skipped (a stop word in device memory: no multi-block kernel reads host
// memory). A watchdog thread runs while gathers are pending on the device: it checks the
// awaited peers' life locks (shm_transport.h) and the op's deadline, and on a dead peer (or, as
// a backstop, shortly after a missed deadline) sets the abort word and records an error naming
// rank, peer, key and minibatch, raised at the next keyed call, Work::wait() or the barrier.
// quiesce() and close() poll events of the streams ODC used, under the deadline: they never
// wait indefinitely for a spinning kernel.
//
// connect() first checks, collectively, that every GPU pair of the group has peer access with
// native atomics (concurrent remote reductions lose updates without them) and that this build
// has kernels for every GPU; otherwise every rank refuses with the reason (supportProblem()).
//
// One launch per keyed op measured faster than per-peer copy-engine copies or per-peer kernels
// on side streams (benchmarks/probes/probe_nvlink.cu, docs/benchmarks.md); those remain behind
// ODC_CUDA_FUSED=0 (waitFlag/read/accumulate below).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/region_map.h"
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
  void publishFlags(size_t first_offset, size_t count, size_t stride, uint64_t value,
                    Stream stream) override;
  void waitFlag(int peer, size_t flag_offset, uint64_t value, const WaitContext& ctx,
                Stream stream) override;
  void read(int peer, size_t offset, void* dst, size_t bytes, Stream stream) override;
  void readAs(int peer, size_t offset, void* dst, size_t numel, DType from, DType to,
              Stream stream) override;
  std::shared_ptr<void> pinLocal() override;
  std::string createAccumulators(uint64_t gen) override;
  void openAccumulators(int peer, const std::string& blob) override;
  void closePeerAccumulators() override;
  void dropAccumulators() override;
  std::shared_ptr<void> pinAccumulators() override;
  void accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset, uint64_t epoch,
                  const void* src, size_t numel, DType dtype, double scale, Stream stream) override;
  double gatherPeers(size_t offset, size_t flag_offset, uint64_t value, size_t numel, DType from,
                     DType to, const std::vector<PeerRead>& reads, Stream stream) override;
  void pushPeers(size_t accum_offset, size_t elem, size_t locks_offset, uint64_t epoch,
                 size_t numel, DType dtype, double scale, const std::vector<PeerPush>& pushes,
                 Stream stream) override;
  void endOp(Stream stream) override;
  void quiesce(Stream stream) override;

  void storeControl(size_t offset, uint64_t value) override;
  uint64_t loadControl(int peer, size_t offset) override;
  void* localPointer(size_t offset) override;
  void zeroLocal(size_t offset, size_t bytes, Stream stream) override;
  bool peerAlive(int peer) override;
  int deviceIndex() const override { return device_; }
  size_t allocationBytes(size_t bytes) const override;

  // Raises if a device-side wait gave up or the watchdog recorded an error (called before every
  // keyed op, in Work::wait and in quiesce). Sticky: every later call raises too.
  void checkDeviceErrors();
  void checkErrors() override { checkDeviceErrors(); }
  // Sets the abort word: every device wait returns at once, copies behind them are skipped.
  void abort() override;

  // Collective over the group: "" when every rank's GPU can run this transport with every
  // peer's (peer access with native atomics, a kernel image for its architecture), otherwise
  // the first problem, naming the rank and GPUs; identical on every rank.
  static std::string supportProblem(int rank, int world, int device, Rendezvous& rdv,
                                    const std::string& prefix, std::chrono::milliseconds timeout);

 private:
  // One enqueued device wait the watchdog follows until its event completes.
  // Fixed arrays, kept in a reused vector: no allocation per enqueued wait.
  struct PendingWait {
    cudaEvent_t done = nullptr;
    Clock::time_point deadline;
    int count = 0;
    int peers[cuda_ipc::kMaxPeers];
    std::function<std::string()> describe[cuda_ipc::kMaxPeers];  // per peer
  };
  void track(Stream stream);
  // Follows the waits just enqueued on `stream` (recorded event) for the watchdog; `fill` sets
  // the entry's count, peers and descriptions.
  void watch(cudaStream_t stream, Clock::time_point deadline,
             const std::function<void(PendingWait&)>& fill);
  void watchdogLoop();
  void fail(const std::string& message, bool timeout);
  uint64_t deviceDeadline(Clock::time_point deadline) const;
  void calibrateClock();
  // Polls until every stream ODC used has finished its work, or `deadline`; false on timeout.
  bool drain(Clock::time_point deadline, bool raise_errors);
  uint8_t* at(int peer, size_t offset) const { return regions_.at(rank_, peer, offset); }
  // The fp32 accumulator element `elem` of the key accumulator at `accum_offset` in `peer`.
  void* accumAt(int peer, size_t accum_offset, size_t elem, DType dtype);
  // The stream a peer's part of the current op runs on: its side stream, forked from `main`
  // at the op's first peer access, so reads from / pushes to different peers run concurrently.
  cudaStream_t peerStream(int peer, cudaStream_t main);

  const int rank_;
  const int world_;
  const int device_;
  int sm_count_ = 0;
  // Thread blocks per launch over all peers (the .cpp says why): the push's, ODC_CUDA_CTAS,
  // default 1 per SM; the gather's, ODC_CUDA_GATHER_CTAS, default kGatherCtas (at most 1 per
  // SM), or ODC_CUDA_CTAS where only that is set.
  // ODC_CUDA_FUSED=0 falls back to per-peer copy-engine reads and per-peer push kernels.
  static constexpr int kGatherCtas = 32;
  int ctas_ = 0;
  int gather_ctas_ = 0;
  bool fused_ = true;
  // kernels.h PushMode: kBulk on sm_90 and later, unless ODC_CUDA_PUSH=element (ODC_CUDA_PUSH=bulk
  // on an older GPU still runs the element path).
  cuda_ipc::PushMode push_mode_ = cuda_ipc::PushMode::kElement;
  std::chrono::milliseconds timeout_{0};
  size_t bytes_ = 0;
  // The own cudaMalloc: freed at close() once no pin (pinLocal) holds it any more.
  std::shared_ptr<void> own_;
  // Device pointers of every rank's region (regions_.bases[rank_] is the own cudaMalloc) and
  // accumulators: one cudaMalloc per generation, exported by its IPC handle (engine.h, "Gradient
  // memory"); acc_own_ frees the own one once no pin holds it.
  RegionMap regions_;
  std::shared_ptr<void> acc_own_;
  ShmTransport control_;
  cuda_ipc::DeviceError* error_host_ = nullptr;  // mapped pinned memory
  cuda_ipc::DeviceError* error_device_ = nullptr;
  // The device stop word (kernels.h): set by a wait kernel that failed or saw abort, and by
  // abort(); read by every block of the copy and push kernels.
  uint32_t* stop_ = nullptr;
  // Descriptions of in-flight device waits, indexed by the slot a failing wait reports.
  static constexpr uint32_t kSlots = 4096;
  std::vector<std::function<std::string()>> wait_descriptions_;
  uint32_t next_slot_ = 0;
  std::mutex mu_;
  // %globaltimer - steady_clock, in ns (calibrated at connect and at every barrier).
  std::atomic<int64_t> clock_offset_ns_{0};
  cudaStream_t ctl_stream_ = nullptr;       // calibration
  std::vector<cudaStream_t> used_streams_;  // streams with ODC work since the last drain
  // Watchdog (see above); wd_mu_ guards everything below.
  std::thread watchdog_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  bool wd_stop_ = false;
  std::vector<PendingWait> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::string host_error_;  // first error the watchdog recorded
  bool host_error_is_timeout_ = false;
  // Set (release) once host_error_ holds an error: the per-call check reads only this word.
  std::atomic<bool> has_host_error_{false};
  std::vector<cudaStream_t> side_;   // per peer
  std::vector<cudaEvent_t> joined_;  // per peer: end of its part of the current op
  std::vector<bool> side_used_;
  cudaEvent_t fork_ = nullptr;
  bool forked_ = false;
};

}  // namespace torch_odc
