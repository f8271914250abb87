#include "transport/cuda_ipc/cuda_ipc_transport.h"

#include <algorithm>
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
      bases_(world, nullptr),
      control_(rank, world),
      wait_descriptions_(kSlots) {}

CudaIpcTransport::~CudaIpcTransport() { close(); }

void CudaIpcTransport::connect(Rendezvous& rdv, const std::string& prefix,
                               const RegionLayout& layout, std::chrono::milliseconds timeout) {
  DeviceGuard guard(device_);
  timeout_ = timeout;
  bytes_ = layout.bytes();
  check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_), rank_,
        "cudaDeviceGetAttribute");
  ctas_ = 2 * sm_count_;
  if (const char* env = std::getenv("ODC_CUDA_CTAS")) ctas_ = std::max(1, std::atoi(env));
  if (const char* env = std::getenv("ODC_CUDA_FUSED")) fused_ = std::string(env) != "0";
  control_.connect(rdv, prefix + "/ctl", layout.controlOnly(), timeout);
  check(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(cuda_ipc::DeviceError),
                      cudaHostAllocMapped),
        rank_, "cudaHostAlloc");
  std::memset(error_host_, 0, sizeof(cuda_ipc::DeviceError));
  check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0), rank_,
        "cudaHostGetDevicePointer");

  void* base = nullptr;
  check(cudaMalloc(&base, bytes_), rank_,
        "cudaMalloc of the " + std::to_string(bytes_) + "-byte ODC region");
  bases_[rank_] = static_cast<uint8_t*>(base);
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
    bases_[r] = static_cast<uint8_t*>(p);
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
  // Nobody may use a region before its owner zeroed it and every rank opened every handle.
  rdv.set(prefix + "/ipc-open/" + std::to_string(rank_), "1");
  for (int r = 0; r < world_; ++r) {
    if (r != rank_) rdv.get(prefix + "/ipc-open/" + std::to_string(r), timeout);
  }
}

void CudaIpcTransport::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (bases_.empty()) return;
  DeviceGuard guard(device_);
  cudaDeviceSynchronize();
  for (int r = 0; r < world_; ++r) {
    if (!bases_[r]) continue;
    if (r == rank_) {
      cudaFree(bases_[r]);
    } else {
      cudaIpcCloseMemHandle(bases_[r]);
    }
    bases_[r] = nullptr;
  }
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
  if (error_host_) cudaFreeHost(error_host_);
  error_host_ = nullptr;
  error_device_ = nullptr;
  control_.close();
}

uint8_t* CudaIpcTransport::at(int peer, size_t offset) const {
  uint8_t* base = bases_.at(static_cast<size_t>(peer));
  if (!base) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": region of rank " +
                   std::to_string(peer) + " is not mapped (transport closed?)");
  }
  return base + offset;
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
  for (int r = 0; r < world_; ++r) {
    if (!side_used_[r]) continue;
    check(cudaEventRecord(joined_[r], side_[r]), rank_, "join event");
    check(cudaStreamWaitEvent(asStream(stream), joined_[r], 0), rank_, "join wait");
    side_used_[r] = false;
  }
  forked_ = false;
}

void CudaIpcTransport::checkDeviceErrors() {
  if (error_host_ && reinterpret_cast<volatile uint32_t*>(&error_host_->flag)[0] != 0) {
    const uint32_t slot = reinterpret_cast<volatile uint32_t*>(&error_host_->slot)[0];
    std::string what;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const auto& describe = wait_descriptions_[slot % kSlots];
      what = describe ? describe() : std::string("a peer's publish");
    }
    throw OdcTimeout("odc: rank " + std::to_string(rank_) + " timed out (on the GPU, after " +
                     std::to_string(timeout_.count() / 1000.0) + " s) waiting for " + what);
  }
}

void CudaIpcTransport::writeLocal(size_t offset, const void* src, size_t bytes, Stream stream) {
  check(cudaMemcpyAsync(at(rank_, offset), src, bytes, cudaMemcpyDeviceToDevice, asStream(stream)),
        rank_, "shard cache copy");
}

void CudaIpcTransport::publish(size_t flag_offset, uint64_t value, Stream stream) {
  cuda_ipc::launchPublish(reinterpret_cast<uint64_t*>(at(rank_, flag_offset)), value,
                          asStream(stream));
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
  const auto remaining =
      std::chrono::duration_cast<std::chrono::nanoseconds>(ctx.deadline - Clock::now());
  cuda_ipc::launchWait(reinterpret_cast<const uint64_t*>(at(peer, flag_offset)), value,
                       static_cast<uint64_t>(std::max<int64_t>(remaining.count(), 0)),
                       error_device_, slot, peerStream(peer, asStream(stream)));
}

void CudaIpcTransport::read(int peer, size_t offset, void* dst, size_t bytes, Stream stream) {
  check(cudaMemcpyAsync(dst, at(peer, offset), bytes, cudaMemcpyDeviceToDevice,
                        peerStream(peer, asStream(stream))),
        rank_, "peer read from rank " + std::to_string(peer));
}

void CudaIpcTransport::accumulate(int peer, size_t accum_offset, size_t elem,
                                  size_t /*locks_offset*/, const void* src, size_t numel,
                                  DType dtype, double scale, Stream stream) {
  cuda_ipc::launchPush(accumAt(peer, accum_offset, elem, dtype), src, numel, dtype,
                       static_cast<float>(scale), sm_count_, peerStream(peer, asStream(stream)));
}

double CudaIpcTransport::gatherPeers(size_t offset, size_t flag_offset, uint64_t value,
                                     size_t bytes, const std::vector<PeerRead>& reads,
                                     Stream stream) {
  if (!fused_ || reads.size() > static_cast<size_t>(cuda_ipc::kMaxPeers)) {
    return Transport::gatherPeers(offset, flag_offset, value, bytes, reads, stream);
  }
  checkDeviceErrors();
  cuda_ipc::GatherArgs args;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& r : reads) {
      const int i = args.count++;
      args.src[i] = at(r.peer, offset);
      args.dst[i] = static_cast<uint8_t*>(r.dst);
      args.flag[i] = reinterpret_cast<const uint64_t*>(at(r.peer, flag_offset));
      args.slot[i] = next_slot_++ % kSlots;
      wait_descriptions_[args.slot[i]] = r.ctx.describe;
    }
  }
  if (reads.empty()) return 0;
  const auto remaining = std::chrono::duration_cast<std::chrono::nanoseconds>(
      reads.front().ctx.deadline - Clock::now());
  cuda_ipc::launchGather(args, bytes, value,
                         static_cast<uint64_t>(std::max<int64_t>(remaining.count(), 0)),
                         error_device_, ctas_, asStream(stream));
  return 0;
}

void CudaIpcTransport::pushPeers(size_t accum_offset, size_t elem, size_t locks_offset,
                                 size_t numel, DType dtype, double scale,
                                 const std::vector<PeerPush>& pushes, Stream stream) {
  if (!fused_ || pushes.size() > static_cast<size_t>(cuda_ipc::kMaxPeers)) {
    Transport::pushPeers(accum_offset, elem, locks_offset, numel, dtype, scale, pushes, stream);
    return;
  }
  cuda_ipc::PushArgs args;
  for (const auto& p : pushes) {
    const int i = args.count++;
    args.dst[i] = accumAt(p.peer, accum_offset, elem, dtype);
    args.src[i] = p.src;
  }
  cuda_ipc::launchPushAll(args, numel, dtype, static_cast<float>(scale), ctas_, asStream(stream));
}

void* CudaIpcTransport::accumAt(int peer, size_t accum_offset, size_t elem, DType dtype) {
  if (accumDtypeFor(dtype) != DType::kFloat32) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": CUDA pushes of " + dtypeName(dtype) +
                   " are not supported (fp32, bf16, fp16)");
  }
  return at(peer, accum_offset) + elem * sizeof(float);
}

void CudaIpcTransport::quiesce(Stream) {
  // Keyed ops run on whatever streams FSDP2 used; the barrier is the one place to wait for all.
  DeviceGuard guard(device_);
  check(cudaDeviceSynchronize(), rank_, "cudaDeviceSynchronize at the minibatch barrier");
  checkDeviceErrors();
}

void CudaIpcTransport::storeControl(size_t offset, uint64_t value) {
  control_.storeControl(offset, value);
}

uint64_t CudaIpcTransport::loadControl(int peer, size_t offset) {
  return control_.loadControl(peer, offset);
}

void* CudaIpcTransport::localPointer(size_t offset) { return at(rank_, offset); }

void CudaIpcTransport::zeroLocal(size_t offset, size_t bytes, Stream stream) {
  check(cudaMemsetAsync(at(rank_, offset), 0, bytes, asStream(stream)), rank_, "zero");
}

bool CudaIpcTransport::peerAlive(int peer) { return control_.peerAlive(peer); }

}  // namespace torch_odc
