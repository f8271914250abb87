#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace torch_odc {

namespace {

void check(cudaError_t err, int rank, const std::string& what) {
  if (err != cudaSuccess) {
    throw OdcError("odc: rank " + std::to_string(rank) + ": CUDA error in " + what + ": " +
                   cudaGetErrorString(err));
  }
}

cudaStream_t asStream(Stream s) { return static_cast<cudaStream_t>(s); }

int64_t steadyNs(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Bytes to cudaMalloc for a region peers will cudaIpcOpenMemHandle: rounded up to a whole number
// of 2 MiB pages. On an H200 (benchmarks/results/ipc_open_size_1gpu_h200.log) opening a peer's
// 1.92 GiB takes ~0.2 ms (closing it 0.1 ms) when its size is a multiple of 2 MiB, 14-17 ms
// (closing 4-5 ms) when it is not: the accumulators are re-opened at every gradient-memory restore.
size_t exportedBytes(size_t n) {
  constexpr size_t kPage = size_t{2} << 20;
  return (n + kPage - 1) / kPage * kPage;
}

volatile uint32_t* word(uint32_t* p) { return reinterpret_cast<volatile uint32_t*>(p); }

// Makes `device` current for the scope (IPC opens and allocations are per device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() { cudaSetDevice(prev_); }

 private:
  int prev_ = 0;
};

}  // namespace

CudaIpcTransport::CudaIpcTransport(int rank, int world, int device)
    : rank_(rank),
      world_(world),
      device_(device),
      regions_(world),
      control_(rank, world),
      wait_descriptions_(kSlots) {}

CudaIpcTransport::~CudaIpcTransport() { close(); }

size_t CudaIpcTransport::allocationBytes(size_t bytes) const { return exportedBytes(bytes); }

void CudaIpcTransport::connect(Rendezvous& rdv, const std::string& prefix,
                               const RegionLayout& layout, std::chrono::milliseconds timeout) {
  DeviceGuard guard(device_);
  timeout_ = timeout;
  bytes_ = layout.accumBegin();
  regions_.setLayout(layout, world_);
  const std::string problem =
      supportProblem(rank_, world_, device_, rdv, prefix + "/support", timeout);
  if (!problem.empty()) {
    throw OdcError("odc: rank " + std::to_string(rank_) +
                   ": the CUDA IPC transport cannot run on this group: " + problem);
  }
  check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), rank_,
        "cudaDeviceGetAttribute");
  // The push: one block per SM (the bulk reductions need them all to reach NCCL's
  // reduce-scatter; a second resident block per SM slowed FSDP2's copies and the model's kernels,
  // which these launches overlap, more than it sped the push up: docs/benchmarks.md, issue 30).
  // The gather: kGatherCtas blocks in all. Its loads reach NVLink's bandwidth from 16 blocks
  // (2 H200), and every block it holds is an SM the model's kernels wait for while a prefetched
  // gather runs beside them (2 H200, equal lengths: 0.996x FSDP2 with 132 blocks, 1.000-1.002x with
  // 32; docs/benchmarks.md, "Thread blocks per launch").
  ctas_ = sm_count_;
  if (const char* env = std::getenv("ODC_CUDA_CTAS")) ctas_ = std::max(1, std::atoi(env));
  gather_ctas_ = std::getenv("ODC_CUDA_CTAS") ? ctas_ : std::min(sm_count_, kGatherCtas);
  if (const char* env = std::getenv("ODC_CUDA_GATHER_CTAS")) {
    gather_ctas_ = std::max(1, std::atoi(env));
  }
  if (const char* env = std::getenv("ODC_CUDA_FUSED")) fused_ = std::string(env) != "0";
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_), rank_,
        "cudaDeviceGetAttribute");
  push_mode_ = major >= 9 ? cuda_ipc::PushMode::kBulk : cuda_ipc::PushMode::kElement;
  if (const char* env = std::getenv("ODC_CUDA_PUSH")) {
    const std::string mode(env);
    if (mode != "bulk" && mode != "element") {
      throw OdcError("odc: rank " + std::to_string(rank_) + ": ODC_CUDA_PUSH=" + mode +
                     " is not one of bulk, element");
    }
    if (mode == "element") push_mode_ = cuda_ipc::PushMode::kElement;
  }
  control_.connect(rdv, prefix + "/ctl", layout.controlOnly(), timeout);
  check(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(cuda_ipc::DeviceError),
                      cudaHostAllocMapped),
        rank_, "cudaHostAlloc");
  std::memset(error_host_, 0, sizeof(cuda_ipc::DeviceError));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0), rank_,
        "cudaHostGetDevicePointer");
  check(cudaMalloc(reinterpret_cast<void**>(&stop_), sizeof(uint32_t)), rank_, "cudaMalloc");
  check(cudaMemset(stop_, 0, sizeof(uint32_t)), rank_, "cudaMemset");

  void* base = nullptr;
  check(cudaMalloc(&base, exportedBytes(bytes_)), rank_,
        "cudaMalloc of the " + std::to_string(bytes_) + "-byte ODC region");
  regions_.bases[rank_] = static_cast<uint8_t*>(base);
  own_ = std::shared_ptr<void>(base, [device = device_](void* p) {
    DeviceGuard g(device);
    cudaFree(p);  // at exit the context may be gone already: nothing to report then
  });
  check(cudaMemset(base, 0, bytes_), rank_, "cudaMemset");
  check(cudaDeviceSynchronize(), rank_, "cudaDeviceSynchronize");
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, base), rank_, "cudaIpcGetMemHandle");
  rdv.set(prefix + "/ipc/" + std::to_string(rank_),
          std::string(reinterpret_cast<const char*>(&handle), sizeof handle));
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const std::string blob = rdv.get(prefix + "/ipc/" + std::to_string(r), timeout);
    if (blob.size() != sizeof(cudaIpcMemHandle_t)) {
      throw OdcError("odc: rank " + std::to_string(rank_) + ": bad IPC handle from rank " +
                     std::to_string(r));
    }
    cudaIpcMemHandle_t peer_handle;
    std::memcpy(&peer_handle, blob.data(), sizeof peer_handle);
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, peer_handle, cudaIpcMemLazyEnablePeerAccess), rank_,
          "cudaIpcOpenMemHandle of rank " + std::to_string(r) + "'s region");
    regions_.bases[r] = static_cast<uint8_t*>(p);
  }
  side_.assign(world_, nullptr);
  joined_.assign(world_, nullptr);
  side_used_.assign(world_, false);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    check(cudaStreamCreateWithFlags(&side_[r], cudaStreamNonBlocking), rank_, "stream create");
    check(cudaEventCreateWithFlags(&joined_[r], cudaEventDisableTiming), rank_, "event create");
  }
  check(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming), rank_, "event create");
  check(cudaStreamCreateWithFlags(&ctl_stream_, cudaStreamNonBlocking), rank_, "stream create");
  calibrateClock();
  wd_stop_ = false;
  watchdog_ = std::thread([this] { watchdogLoop(); });
  // Nobody may use a region before its owner zeroed it and every rank opened every handle.
  rdv.set(prefix + "/ipc-open/" + std::to_string(rank_), "1");
  for (int r = 0; r < world_; ++r) {
    if (r != rank_) rdv.get(prefix + "/ipc-open/" + std::to_string(r), timeout);
  }
}

void CudaIpcTransport::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.bases.empty()) return;
  DeviceGuard guard(device_);
  // No device-wide synchronize: wait (under the deadline) only for the streams ODC used. The
  // watchdog keeps running meanwhile, so a wait on a peer that is gone is aborted within
  // milliseconds; abort() before close() makes every pending wait return at once.
  const bool drained = drain(Clock::now() + timeout_, /*raise_errors=*/false);
  {
    std::lock_guard<std::mutex> wd(wd_mu_);
    wd_stop_ = true;
  }
  wd_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (!drained) {
    // A kernel of ours still runs: freeing what it uses would be worse than leaking it.
    std::fprintf(stderr,
                 "odc: rank %d: ODC device work still pending at close after %.1f s; its "
                 "memory is not freed\n",
                 rank_, timeout_.count() / 1000.0);
    regions_.bases.clear();
    regions_.acc_bases.clear();
    new std::shared_ptr<void>(std::move(own_));      // leaked on purpose, pins or not
    new std::shared_ptr<void>(std::move(acc_own_));  // (the accumulators too)
    control_.close();
    return;
  }
  for (int r = 0; r < world_; ++r) {
    if (regions_.bases[r] && r != rank_) cudaIpcCloseMemHandle(regions_.bases[r]);
    regions_.bases[r] = nullptr;
    if (r < static_cast<int>(regions_.acc_bases.size()) && regions_.acc_bases[r] && r != rank_) {
      cudaIpcCloseMemHandle(regions_.acc_bases[r]);
    }
  }
  regions_.acc_bases.clear();
  acc_own_.reset();  // freed here, or when the last gradient view is freed
  own_.reset();      // freed here, or when the last tensor viewing it is freed
  regions_.bases.clear();
  for (auto& s : side_) {
    if (s) cudaStreamDestroy(s);
    s = nullptr;
  }
  for (auto& e : joined_) {
    if (e) cudaEventDestroy(e);
    e = nullptr;
  }
  if (fork_) cudaEventDestroy(fork_);
  fork_ = nullptr;
  if (ctl_stream_) cudaStreamDestroy(ctl_stream_);
  ctl_stream_ = nullptr;
  for (auto& p : pending_) cudaEventDestroy(p.done);
  pending_.clear();
  for (auto e : free_events_) cudaEventDestroy(e);
  free_events_.clear();
  if (error_host_) cudaFreeHost(error_host_);
  error_host_ = nullptr;
  error_device_ = nullptr;
  if (stop_) cudaFree(stop_);
  stop_ = nullptr;
  control_.close();
}

void CudaIpcTransport::abort() {
  if (error_host_) {
    *word(&error_host_->abort) = 1;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  if (stop_ && ctl_stream_) {
    // Running waits see the host word and set the stop word themselves; this sets it for copies
    // and pushes queued behind waits that already completed. ctl_stream_ is non-blocking, so the
    // write runs beside a spinning kernel.
    DeviceGuard guard(device_);
    cudaMemsetAsync(stop_, 0x01, 1, ctl_stream_);
    cudaGetLastError();  // best effort: abort never throws
  }
}

std::string CudaIpcTransport::supportProblem(int rank, int world, int device, Rendezvous& rdv,
                                             const std::string& prefix,
                                             std::chrono::milliseconds timeout) {
  std::string problem;
  char bus[64] = {0};
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) != cudaSuccess) {
    cudaGetLastError();
    problem = "cannot read the PCI bus id of cuda:" + std::to_string(device);
  }
  if (problem.empty()) {
    if (const cudaError_t err = cuda_ipc::kernelImageProblem(device); err != cudaSuccess) {
      cudaDeviceProp prop{};
      cudaGetDeviceProperties(&prop, device);
      problem = "this build of torch_odc has no kernels for cuda:" + std::to_string(device) + " (" +
                prop.name + ", compute capability " + std::to_string(prop.major) + "." +
                std::to_string(prop.minor) + "): " + cudaGetErrorString(err) +
                "; rebuild with that architecture";
    }
  }
  rdv.set(prefix + "/bus/" + std::to_string(rank), bus);
  for (int r = 0; r < world && problem.empty(); ++r) {
    if (r == rank) continue;
    const std::string peer_bus = rdv.get(prefix + "/bus/" + std::to_string(r), timeout);
    if (peer_bus.empty() || peer_bus == bus) continue;  // unknown (it reports why) or same GPU
    int peer_device = -1;
    if (cudaDeviceGetByPCIBusId(&peer_device, peer_bus.c_str()) != cudaSuccess) {
      cudaGetLastError();
      problem = "rank " + std::to_string(r) + "'s GPU (" + peer_bus +
                ") is not visible in this process (CUDA_VISIBLE_DEVICES?), so peer access with "
                "native atomics cannot be checked";
      break;
    }
    int access = 0, atomics = 0;
    cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported, device, peer_device);
    cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported, device, peer_device);
    cudaGetLastError();
    const std::string pair = "cuda:" + std::to_string(device) + " (" + bus + ") and rank " +
                             std::to_string(r) + "'s cuda:" + std::to_string(peer_device) + " (" +
                             peer_bus + ")";
    if (!access) {
      problem = pair + " have no peer access";
    } else if (!atomics) {
      problem = pair +
                " have peer access without native atomics: concurrent remote "
                "reductions would lose updates";
    }
  }
  rdv.set(prefix + "/verdict/" + std::to_string(rank), "v" + problem);
  std::string first;
  for (int r = 0; r < world; ++r) {
    const std::string v =
        r == rank ? "v" + problem : rdv.get(prefix + "/verdict/" + std::to_string(r), timeout);
    if (v.size() > 1 && first.empty()) first = "rank " + std::to_string(r) + ": " + v.substr(1);
  }
  return first;
}

void CudaIpcTransport::calibrateClock() {
  // Best of a few round trips: the offset is taken at the midpoint of the shortest one.
  int64_t best_rtt = INT64_MAX;
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    cuda_ipc::launchReadClock(error_device_, ctl_stream_);
    check(cudaStreamSynchronize(ctl_stream_), rank_, "clock calibration");
    const auto t1 = Clock::now();
    const int64_t rtt = steadyNs(t1) - steadyNs(t0);
    const uint64_t device_ns = *reinterpret_cast<volatile uint64_t*>(&error_host_->clock);
    if (rtt < best_rtt) {
      best_rtt = rtt;
      clock_offset_ns_.store(static_cast<int64_t>(device_ns) - (steadyNs(t0) + rtt / 2));
    }
  }
}

uint64_t CudaIpcTransport::deviceDeadline(Clock::time_point deadline) const {
  return static_cast<uint64_t>(std::max<int64_t>(steadyNs(deadline) + clock_offset_ns_.load(), 0));
}

void CudaIpcTransport::track(Stream stream) {
  const auto s = asStream(stream);
  if (std::find(used_streams_.begin(), used_streams_.end(), s) == used_streams_.end()) {
    used_streams_.push_back(s);
  }
}

void CudaIpcTransport::watch(cudaStream_t stream, Clock::time_point deadline,
                             const std::function<void(PendingWait&)>& fill) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(wd_mu_);
    if (!free_events_.empty()) {
      ev = free_events_.back();
      free_events_.pop_back();
    }
  }
  if (!ev) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), rank_, "event create");
  check(cudaEventRecord(ev, stream), rank_, "wait event");
  bool was_empty;
  {
    std::lock_guard<std::mutex> lock(wd_mu_);
    was_empty = pending_.empty();
    pending_.emplace_back();
    auto& w = pending_.back();
    w.done = ev;
    w.deadline = deadline;
    fill(w);
  }
  // The watchdog sleeps on the condition only while nothing is pending; otherwise it polls.
  if (was_empty) wd_cv_.notify_all();
}

void CudaIpcTransport::fail(const std::string& message, bool timeout) {
  abort();
  std::lock_guard<std::mutex> lock(wd_mu_);
  if (host_error_.empty()) {
    host_error_ = message;
    host_error_is_timeout_ = timeout;
    has_host_error_.store(true, std::memory_order_release);
  }
}

void CudaIpcTransport::watchdogLoop() {
  // The device deadline fires first and names its wait precisely; the watchdog's own deadline
  // check is a backstop (e.g. a drifting device clock), a little later.
  const auto grace = std::clamp<std::chrono::milliseconds>(
      timeout_ / 20, std::chrono::milliseconds(50), std::chrono::milliseconds(1000));
  const std::string me = "odc: rank " + std::to_string(rank_);
  std::unique_lock<std::mutex> lock(wd_mu_);
  while (!wd_stop_) {
    if (pending_.empty()) {
      wd_cv_.wait(lock, [this] { return wd_stop_ || !pending_.empty(); });
      continue;
    }
    // Completed waits leave in order of completion; the rest are checked.
    std::string error;
    bool is_timeout = false;
    for (auto it = pending_.begin(); it != pending_.end();) {
      const cudaError_t q = cudaEventQuery(it->done);
      if (q == cudaSuccess) {
        free_events_.push_back(it->done);
        it = pending_.erase(it);
        continue;
      }
      if (q != cudaErrorNotReady) {
        cudaGetLastError();
        error = me + ": CUDA error while waiting on the GPU for " + it->describe[0]() + ": " +
                cudaGetErrorString(q);
        break;
      }
      if (error.empty()) {
        for (int i = 0; i < it->count; ++i) {
          if (!control_.peerAlive(it->peers[i])) {
            error = me + ": the peer process exited (or detached) while this rank waited on " +
                    "the GPU for " + it->describe[i]();
            break;
          }
        }
      }
      if (error.empty() && Clock::now() >= it->deadline + grace) {
        error = me + " timed out (after " + std::to_string(timeout_.count() / 1000.0) +
                " s, host watchdog) waiting on the GPU for " + it->describe[0]();
        is_timeout = true;
      }
      if (!error.empty()) break;
      ++it;
    }
    if (!error.empty() && host_error_.empty()) {
      lock.unlock();
      fail(error, is_timeout);
      lock.lock();
    }
    wd_cv_.wait_for(lock, std::chrono::milliseconds(5), [this] { return wd_stop_; });
  }
}

bool CudaIpcTransport::drain(Clock::time_point deadline, bool raise_errors) {
  std::vector<cudaEvent_t> events;
  for (auto s : used_streams_) {
    cudaEvent_t ev = nullptr;
    if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventRecord(ev, s) != cudaSuccess) {
      cudaGetLastError();
      if (ev) cudaEventDestroy(ev);
      continue;
    }
    events.push_back(ev);
  }
  bool done = true;
  auto sleep = std::chrono::microseconds(20);
  try {
    for (auto ev : events) {
      while (cudaEventQuery(ev) == cudaErrorNotReady) {
        if (raise_errors) checkDeviceErrors();
        if (Clock::now() >= deadline) {
          done = false;
          break;
        }
        std::this_thread::sleep_for(sleep);
        if (sleep < std::chrono::milliseconds(1)) sleep *= 2;
      }
      if (!done) break;
    }
  } catch (...) {
    for (auto ev : events) cudaEventDestroy(ev);
    throw;
  }
  for (auto ev : events) cudaEventDestroy(ev);
  if (done) used_streams_.clear();
  return done;
}

cudaStream_t CudaIpcTransport::peerStream(int peer, cudaStream_t main) {
  if (peer == rank_) return main;
  if (!forked_) {
    check(cudaEventRecord(fork_, main), rank_, "fork event");
    forked_ = true;
  }
  if (!side_used_[peer]) {
    check(cudaStreamWaitEvent(side_[peer], fork_, 0), rank_, "fork wait");
    side_used_[peer] = true;
  }
  return side_[peer];
}

void CudaIpcTransport::endOp(Stream stream) {
  track(stream);  // every keyed op ends here: quiesce and close wait for these streams
  for (int r = 0; r < world_; ++r) {
    if (!side_used_[r]) continue;
    check(cudaEventRecord(joined_[r], side_[r]), rank_, "join event");
    check(cudaStreamWaitEvent(asStream(stream), joined_[r], 0), rank_, "join wait");
    side_used_[r] = false;
  }
  forked_ = false;
}

void CudaIpcTransport::checkDeviceErrors() {
  if (has_host_error_.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(wd_mu_);
    if (!host_error_.empty()) {
      if (host_error_is_timeout_) throw OdcTimeout(host_error_);
      throw OdcError(host_error_);
    }
  }
  if (!error_host_ || *word(&error_host_->flag) == 0) return;
  // A wait claimed the error (2) and is writing its slot: it publishes 1 right after.
  for (int i = 0; i < 100000 && *word(&error_host_->flag) != 1; ++i) std::this_thread::yield();
  const uint32_t slot = *word(&error_host_->slot);
  std::string what;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto& describe = wait_descriptions_[slot % kSlots];
    what = describe ? describe() : std::string("a peer's publish");
  }
  throw OdcTimeout("odc: rank " + std::to_string(rank_) + " timed out (on the GPU, after " +
                   std::to_string(timeout_.count() / 1000.0) + " s) waiting for " + what);
}

void CudaIpcTransport::writeLocal(size_t offset, const void* src, size_t bytes, Stream stream) {
  track(stream);
  check(cudaMemcpyAsync(at(rank_, offset), src, bytes, cudaMemcpyDeviceToDevice, asStream(stream)),
        rank_, "shard cache copy");
}

void CudaIpcTransport::publish(size_t flag_offset, uint64_t value, Stream stream) {
  cuda_ipc::launchPublish(reinterpret_cast<uint64_t*>(at(rank_, flag_offset)), value,
                          asStream(stream));
}

void CudaIpcTransport::publishFlags(size_t first_offset, size_t count, size_t stride,
                                    uint64_t value, Stream stream) {
  track(stream);
  cuda_ipc::launchPublishFlags(at(rank_, first_offset), count, stride, value, asStream(stream));
}

void CudaIpcTransport::waitFlag(int peer, size_t flag_offset, uint64_t value,
                                const WaitContext& ctx, Stream stream) {
  checkDeviceErrors();
  uint32_t slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    slot = next_slot_++ % kSlots;
    wait_descriptions_[slot] = ctx.describe;
  }
  const cudaStream_t side = peerStream(peer, asStream(stream));
  cuda_ipc::launchWait(reinterpret_cast<const uint64_t*>(at(peer, flag_offset)), value,
                       deviceDeadline(ctx.deadline), error_device_, stop_, slot, side);
  watch(side, ctx.deadline, [&](PendingWait& w) {
    w.count = 1;
    w.peers[0] = peer;
    w.describe[0] = ctx.describe;
  });
}

void CudaIpcTransport::read(int peer, size_t offset, void* dst, size_t bytes, Stream stream) {
  if (peer == rank_) {
    check(cudaMemcpyAsync(dst, at(peer, offset), bytes, cudaMemcpyDeviceToDevice, asStream(stream)),
          rank_, "shard cache read");
    return;
  }
  // A kernel rather than a copy-engine memcpy: it is skipped once a wait failed (the peer's
  // region may be gone).
  cuda_ipc::launchRead(dst, at(peer, offset), bytes, stop_, gather_ctas_,
                       peerStream(peer, asStream(stream)));
}

void CudaIpcTransport::readAs(int peer, size_t offset, void* dst, size_t numel, DType from,
                              DType to, Stream stream) {
  if (from == to) {
    read(peer, offset, dst, numel * elementSize(from), stream);
    return;
  }
  cuda_ipc::launchReadAs(dst, at(peer, offset), numel, from, to, stop_, gather_ctas_,
                         peer == rank_ ? asStream(stream) : peerStream(peer, asStream(stream)));
}

std::shared_ptr<void> CudaIpcTransport::pinLocal() {
  std::lock_guard<std::mutex> lock(mu_);
  return own_;
}

std::shared_ptr<void> CudaIpcTransport::pinAccumulators() {
  std::lock_guard<std::mutex> lock(mu_);
  return acc_own_;
}

std::string CudaIpcTransport::createAccumulators(uint64_t /*gen*/) {
  DeviceGuard guard(device_);
  dropAccumulators();
  void* base = nullptr;
  const cudaError_t err = cudaMalloc(&base, exportedBytes(regions_.acc_bytes));
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: a retry may succeed
    throw OdcError("odc: rank " + std::to_string(rank_) + ": cudaMalloc of the " +
                   std::to_string(regions_.acc_bytes) +
                   "-byte gradient accumulators: " + cudaGetErrorString(err));
  }
  std::shared_ptr<void> own(base, [device = device_](void* p) {
    DeviceGuard g(device);
    cudaFree(p);  // at exit the context may be gone already: nothing to report then
  });
  // Zeroed before any peer can learn the handle (the engine publishes it after this returns).
  check(cudaMemsetAsync(base, 0, regions_.acc_bytes, ctl_stream_), rank_, "cudaMemsetAsync");
  check(cudaStreamSynchronize(ctl_stream_), rank_, "cudaStreamSynchronize");
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, base), rank_, "cudaIpcGetMemHandle");
  {
    std::lock_guard<std::mutex> lock(mu_);
    acc_own_ = std::move(own);
    regions_.acc_bases[rank_] = static_cast<uint8_t*>(base);
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof handle);
}

void CudaIpcTransport::openAccumulators(int peer, const std::string& blob) {
  DeviceGuard guard(device_);
  if (blob.size() != sizeof(cudaIpcMemHandle_t)) {
    throw OdcError("odc: rank " + std::to_string(rank_) +
                   ": bad accumulator IPC handle from rank " + std::to_string(peer));
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, blob.data(), sizeof handle);
  void* p = nullptr;
  check(cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess), rank_,
        "cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s gradient accumulators");
  std::lock_guard<std::mutex> lock(mu_);
  if (regions_.acc_bases[peer]) cudaIpcCloseMemHandle(regions_.acc_bases[peer]);
  regions_.acc_bases[peer] = static_cast<uint8_t*>(p);
}

void CudaIpcTransport::closePeerAccumulators() {
  DeviceGuard guard(device_);
  std::lock_guard<std::mutex> lock(mu_);
  for (int r = 0; r < static_cast<int>(regions_.acc_bases.size()); ++r) {
    if (r == rank_ || !regions_.acc_bases[r]) continue;
    check(cudaIpcCloseMemHandle(regions_.acc_bases[r]), rank_,
          "cudaIpcCloseMemHandle of rank " + std::to_string(r) + "'s gradient accumulators");
    regions_.acc_bases[r] = nullptr;
  }
}

void CudaIpcTransport::dropAccumulators() {
  std::shared_ptr<void> own;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!regions_.acc_bases.empty()) regions_.acc_bases[rank_] = nullptr;
    own = std::move(acc_own_);
  }
  own.reset();  // freed here (outside the lock), or when the last gradient view is freed
}

void CudaIpcTransport::accumulate(int peer, size_t accum_offset, size_t elem,
                                  size_t /*locks_offset*/, uint64_t /*epoch*/, const void* src,
                                  size_t numel, DType dtype, double scale, Stream stream) {
  cuda_ipc::launchPush(accumAt(peer, accum_offset, elem, dtype), src, numel, dtype,
                       static_cast<float>(scale), stop_, sm_count_,
                       peerStream(peer, asStream(stream)));
}

double CudaIpcTransport::gatherPeers(size_t offset, size_t flag_offset, uint64_t value,
                                     size_t numel, DType from, DType to,
                                     const std::vector<PeerRead>& reads, Stream stream) {
  if (!fused_ || reads.size() > static_cast<size_t>(cuda_ipc::kMaxPeers)) {
    return Transport::gatherPeers(offset, flag_offset, value, numel, from, to, reads, stream);
  }
  checkDeviceErrors();
  // Every flag already waited for on this stream (the key's earlier gathers in this minibatch):
  // the copy alone, one launch; a wait of those that failed has set the stop word, so this copy
  // is skipped too.
  const bool wait =
      std::any_of(reads.begin(), reads.end(), [](const PeerRead& r) { return !r.ready_known; });
  cuda_ipc::GatherArgs args;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& r : reads) {
      const int i = args.count++;
      args.src[i] = at(r.peer, offset);
      args.dst[i] = static_cast<uint8_t*>(r.dst);
      args.flag[i] = reinterpret_cast<const uint64_t*>(at(r.peer, flag_offset));
      if (!wait) continue;
      args.slot[i] = next_slot_++ % kSlots;
      wait_descriptions_[args.slot[i]] = r.ctx.describe;
    }
  }
  if (reads.empty()) return 0;
  if (!wait) {
    cuda_ipc::launchGather(args, numel, from, to, value, 0, nullptr, stop_, gather_ctas_,
                           /*wait=*/false, asStream(stream));
    return 0;
  }
  // One deadline for the operation: the earliest of its waits' (all set when it was enqueued).
  Clock::time_point deadline = reads.front().ctx.deadline;
  for (const auto& r : reads) deadline = std::min(deadline, r.ctx.deadline);
  cuda_ipc::launchGather(args, numel, from, to, value, deviceDeadline(deadline), error_device_,
                         stop_, gather_ctas_, /*wait=*/true, asStream(stream));
  watch(asStream(stream), deadline, [&](PendingWait& w) {
    for (const auto& r : reads) {
      w.peers[w.count] = r.peer;
      w.describe[w.count] = r.ctx.describe;
      ++w.count;
    }
  });
  return 0;
}

void CudaIpcTransport::pushPeers(size_t accum_offset, size_t elem, size_t locks_offset,
                                 uint64_t epoch, size_t numel, DType dtype, double scale,
                                 const std::vector<PeerPush>& pushes, Stream stream) {
  if (!fused_ || pushes.size() > static_cast<size_t>(cuda_ipc::kMaxPeers)) {
    Transport::pushPeers(accum_offset, elem, locks_offset, epoch, numel, dtype, scale, pushes,
                         stream);
    return;
  }
  cuda_ipc::PushArgs args;
  for (const auto& p : pushes) {
    const int i = args.count++;
    args.dst[i] = accumAt(p.peer, accum_offset, elem, dtype);
    args.src[i] = p.src;
  }
  cuda_ipc::launchPushAll(args, numel, dtype, static_cast<float>(scale), stop_, ctas_, push_mode_,
                          asStream(stream));
}

void* CudaIpcTransport::accumAt(int peer, size_t accum_offset, size_t elem, DType dtype) {
  if (accumDtypeFor(dtype) != DType::kFloat32) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": CUDA pushes of " + dtypeName(dtype) +
                   " are not supported (fp32, bf16, fp16)");
  }
  return at(peer, accum_offset) + elem * sizeof(float);
}

void CudaIpcTransport::quiesce(Stream stream) {
  // Keyed ops run on whatever streams FSDP2 used; the barrier is the one place to wait for all
  // of them (never the whole device: a spinning wait must not block the host forever).
  DeviceGuard guard(device_);
  track(stream);
  if (!drain(Clock::now() + timeout_, /*raise_errors=*/true)) {
    checkDeviceErrors();
    throw OdcTimeout("odc: rank " + std::to_string(rank_) + " timed out after " +
                     std::to_string(timeout_.count() / 1000.0) +
                     " s at the minibatch barrier waiting for this rank's ODC work on the GPU");
  }
  checkDeviceErrors();
  calibrateClock();
}

void CudaIpcTransport::storeControl(size_t offset, uint64_t value) {
  control_.storeControl(offset, value);
}

uint64_t CudaIpcTransport::loadControl(int peer, size_t offset) {
  return control_.loadControl(peer, offset);
}

void* CudaIpcTransport::localPointer(size_t offset) { return at(rank_, offset); }

void CudaIpcTransport::zeroLocal(size_t offset, size_t bytes, Stream stream) {
  // On the caller's stream (the current stream of this device, where finalize read the
  // accumulators), so the zeroing cannot overtake that read.
  DeviceGuard guard(device_);
  track(stream);
  check(cudaMemsetAsync(at(rank_, offset), 0, bytes, asStream(stream)), rank_, "zero");
}

bool CudaIpcTransport::peerAlive(int peer) { return control_.peerAlive(peer); }

}  // namespace torch_odc
