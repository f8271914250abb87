#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "engine/wait.h"

namespace torch_odc {

namespace {

std::atomic<uint64_t>* atomic64(uint8_t* p) { return reinterpret_cast<std::atomic<uint64_t>*>(p); }
std::atomic<uint32_t>* atomic32(uint8_t* p) { return reinterpret_cast<std::atomic<uint32_t>*>(p); }

std::string sysError(const std::string& what) { return what + ": " + std::strerror(errno); }

float bf16ToFloat(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

float halfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ff;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// fp32 dst += widened 16-bit src * scale.
template <float (*ToFloat)(uint16_t)>
void accumulate16(void* dst, const void* src, size_t numel, double scale) {
  auto* d = static_cast<float*>(dst);
  const auto* s = static_cast<const uint16_t*>(src);
  const float f = static_cast<float>(scale);
  for (size_t i = 0; i < numel; ++i) d[i] += ToFloat(s[i]) * f;
}

}  // namespace

void accumulateCpu(void* dst, const void* src, size_t numel, DType dtype, double scale) {
  switch (dtype) {
    case DType::kFloat32: {
      auto* d = static_cast<float*>(dst);
      const auto* s = static_cast<const float*>(src);
      if (scale == 1.0) {
        for (size_t i = 0; i < numel; ++i) d[i] += s[i];
      } else {
        const float f = static_cast<float>(scale);
        for (size_t i = 0; i < numel; ++i) d[i] += s[i] * f;
      }
      return;
    }
    case DType::kFloat64: {
      auto* d = static_cast<double*>(dst);
      const auto* s = static_cast<const double*>(src);
      for (size_t i = 0; i < numel; ++i) d[i] += s[i] * scale;
      return;
    }
    case DType::kBFloat16:
      accumulate16<bf16ToFloat>(dst, src, numel, scale);
      return;
    case DType::kFloat16:
      accumulate16<halfToFloat>(dst, src, numel, scale);
      return;
    case DType::kByte:
      break;
  }
  throw OdcError(std::string("odc: pushes of ") + dtypeName(dtype) + " are not supported");
}

ShmTransport::ShmTransport(int rank, int world)
    : rank_(rank), world_(world), bases_(world, nullptr), pids_(world, 0) {}

ShmTransport::~ShmTransport() { close(); }

void ShmTransport::connect(Rendezvous& rdv, const std::string& prefix, const RegionLayout& layout,
                           std::chrono::milliseconds timeout) {
  bytes_ = layout.bytes();
  // A name no other job on this host uses: the job token (from rank 0) plus pid and rank.
  std::string token;
  if (rank_ == 0) {
    std::random_device rd;
    token = std::to_string(rd()) + std::to_string(rd());
    rdv.set(prefix + "/shm/token", token);
  } else {
    token = rdv.get(prefix + "/shm/token", timeout);
  }
  name_ = "/odc-" + token.substr(0, 16) + "-" + std::to_string(::getpid()) + "-r" +
          std::to_string(rank_);
  const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0)
    throw OdcError(sysError("odc: rank " + std::to_string(rank_) + ": shm_open " + name_));
  if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
    ::close(fd);
    ::shm_unlink(name_.c_str());
    throw OdcError(sysError("odc: rank " + std::to_string(rank_) + ": ftruncate " + name_ + " to " +
                            std::to_string(bytes_) + " bytes (is /dev/shm large enough?)"));
  }
  void* base = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name_.c_str());
    throw OdcError(sysError("odc: rank " + std::to_string(rank_) + ": mmap " + name_));
  }
  bases_[rank_] = static_cast<uint8_t*>(base);
  pids_[rank_] = ::getpid();
  atomic64(bases_[rank_] + layout.controlPid())->store(static_cast<uint64_t>(::getpid()));
  rdv.set(prefix + "/shm/name/" + std::to_string(rank_), name_);
  try {
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      const std::string peer_name = rdv.get(prefix + "/shm/name/" + std::to_string(r), timeout);
      const int pfd = ::shm_open(peer_name.c_str(), O_RDWR, 0600);
      if (pfd < 0) {
        throw OdcError(sysError("odc: rank " + std::to_string(rank_) + ": opening peer rank " +
                                std::to_string(r) + "'s region " + peer_name));
      }
      void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
      ::close(pfd);
      if (p == MAP_FAILED) {
        throw OdcError(sysError("odc: rank " + std::to_string(rank_) + ": mapping peer rank " +
                                std::to_string(r) + "'s region"));
      }
      bases_[r] = static_cast<uint8_t*>(p);
      pids_[r] = static_cast<int>(atomic64(bases_[r] + layout.controlPid())->load());
    }
    // Every rank has mapped every region: names are no longer needed.
    rdv.set(prefix + "/shm/mapped/" + std::to_string(rank_), "1");
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) rdv.get(prefix + "/shm/mapped/" + std::to_string(r), timeout);
    }
  } catch (...) {
    ::shm_unlink(name_.c_str());
    close();
    throw;
  }
  ::shm_unlink(name_.c_str());
}

void ShmTransport::close() {
  for (auto& b : bases_) {
    if (b) ::munmap(b, bytes_);
    b = nullptr;
  }
}

uint8_t* ShmTransport::at(int peer, size_t offset) const {
  uint8_t* base = bases_.at(static_cast<size_t>(peer));
  if (!base) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": region of rank " +
                   std::to_string(peer) + " is not mapped (transport closed?)");
  }
  return base + offset;
}

void ShmTransport::writeLocal(size_t offset, const void* src, size_t bytes, Stream) {
  std::memcpy(at(rank_, offset), src, bytes);
}

void ShmTransport::publish(size_t flag_offset, uint64_t value, Stream) {
  // Release: a peer that acquires this value sees the cache fill above.
  atomic64(at(rank_, flag_offset))->store(value, std::memory_order_release);
}

void ShmTransport::waitFlag(int peer, size_t flag_offset, uint64_t value, const WaitContext& ctx,
                            Stream) {
  auto* flag = atomic64(at(peer, flag_offset));
  hostWait([&] { return flag->load(std::memory_order_acquire) >= value; },
           [&] { return peerAlive(peer); }, ctx, ("odc: rank " + std::to_string(rank_)).c_str());
}

void ShmTransport::read(int peer, size_t offset, void* dst, size_t bytes, Stream) {
  std::memcpy(dst, at(peer, offset), bytes);
}

void ShmTransport::accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset,
                              const void* src, size_t numel, DType dtype, double scale, Stream) {
  if (numel == 0) return;
  constexpr size_t kBlock = RegionLayout::kLockBlockElems;
  const size_t src_size = elementSize(dtype);
  const size_t acc_size = elementSize(accumDtypeFor(dtype));
  uint8_t* acc = at(peer, accum_offset);
  const auto* s = static_cast<const uint8_t*>(src);
  // Lock blocks are fixed per accumulator (counted from its first element), whatever span a push
  // covers, so two pushes that overlap always take the same lock for the same elements.
  const size_t first_block = elem / kBlock;
  const size_t blocks = (elem + numel - 1) / kBlock - first_block + 1;
  // Start at a rank-dependent block so concurrent pushers spread over the lock words.
  for (size_t i = 0; i < blocks; ++i) {
    const size_t b = first_block + (i + static_cast<size_t>(rank_)) % blocks;
    const size_t begin = std::max(elem, b * kBlock);
    const size_t n = std::min(elem + numel, (b + 1) * kBlock) - begin;
    auto* lock = atomic32(at(peer, locks_offset + b * sizeof(uint32_t)));
    uint32_t expected = 0;
    int spins = 0;
    while (!lock->compare_exchange_weak(expected, 1, std::memory_order_acquire,
                                        std::memory_order_relaxed)) {
      expected = 0;
      if (++spins > 64) std::this_thread::yield();
    }
    accumulateCpu(acc + begin * acc_size, s + (begin - elem) * src_size, n, dtype, scale);
    lock->store(0, std::memory_order_release);
  }
}

void ShmTransport::quiesce(Stream) { std::atomic_thread_fence(std::memory_order_seq_cst); }

void ShmTransport::storeControl(size_t offset, uint64_t value) {
  atomic64(at(rank_, offset))->store(value, std::memory_order_release);
}

uint64_t ShmTransport::loadControl(int peer, size_t offset) {
  return atomic64(at(peer, offset))->load(std::memory_order_acquire);
}

void* ShmTransport::localPointer(size_t offset) { return at(rank_, offset); }

void ShmTransport::zeroLocal(size_t offset, size_t bytes, Stream) {
  std::memset(at(rank_, offset), 0, bytes);
}

bool ShmTransport::peerAlive(int peer) {
  const int pid = pids_.at(static_cast<size_t>(peer));
  if (pid <= 0) return true;
  if (::kill(pid, 0) != 0 && errno != EPERM) return false;
  // A process that exited but was not yet reaped is a zombie: dead for our purposes.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const auto close_paren = line.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= line.size()) return true;
  const char state = line[close_paren + 2];
  return state != 'Z' && state != 'X';
}

}  // namespace torch_odc
