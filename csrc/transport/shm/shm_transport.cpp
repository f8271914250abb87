#include "transport/shm/shm_transport.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>

#include "engine/convert.h"
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
    : rank_(rank),
      world_(world),
      regions_(world),
      pids_(world, 0),
      dead_(new std::atomic<bool>[static_cast<size_t>(world)]) {
  for (int r = 0; r < world_; ++r) dead_[r].store(false);
}

ShmTransport::~ShmTransport() { close(); }

std::string ShmTransport::await(Rendezvous& rdv, const std::string& prefix, const std::string& key,
                                const std::string& what) {
  const auto deadline = Clock::now() + timeout_;
  auto sleep = std::chrono::microseconds(100);
  std::string value;
  while (!rdv.tryGet(key, value)) {
    if (rdv.tryGet(prefix + "/shm/failed", value)) {
      throw OdcError("odc: rank " + std::to_string(rank_) + ": attach failed on another rank (" +
                     value + ")");
    }
    if (Clock::now() >= deadline) {
      throw OdcTimeout("odc: rank " + std::to_string(rank_) + " timed out after " +
                       std::to_string(timeout_.count() / 1000.0) + " s at attach waiting for " +
                       what + ": every rank must call torch_odc.attach() on the same model");
    }
    std::this_thread::sleep_for(sleep);
    if (sleep < std::chrono::milliseconds(10)) sleep *= 2;
  }
  return value;
}

void ShmTransport::connect(Rendezvous& rdv, const std::string& prefix, const RegionLayout& layout,
                           std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  try {
    connectImpl(rdv, prefix, layout);
  } catch (const std::exception& e) {
    // Tell every rank waiting on us, so that each fails now and unlinks what it created.
    try {
      rdv.set(prefix + "/shm/failed", "rank " + std::to_string(rank_) + ": " + e.what());
    } catch (...) {
    }
    unlinkKnownNames();
    close();
    throw;
  }
  // Every rank has mapped every region: names are no longer needed. Each rank unlinks every
  // name it knows, so a region is unlinked even if its owner dies right now.
  unlinkKnownNames();
}

void ShmTransport::connectImpl(Rendezvous& rdv, const std::string& prefix,
                               const RegionLayout& layout) {
  layout_ = layout;
  bytes_ = layout.accumBegin();
  regions_.setLayout(layout, world_);
  const std::string me = "odc: rank " + std::to_string(rank_);
  // A name no other job on this host uses: the job token (from rank 0) plus pid and rank.
  std::string token;
  if (rank_ == 0) {
    std::random_device rd;
    token = std::to_string(rd()) + std::to_string(rd());
    rdv.set(prefix + "/shm/token", token);
  } else {
    token = await(rdv, prefix, prefix + "/shm/token", "rank 0's job token");
  }
  token = token.substr(0, 16);
  name_ = "/odc-" + token + "-" + std::to_string(::getpid()) + "-r" + std::to_string(rank_);
  peer_names_.assign(static_cast<size_t>(world_), std::string());
  peer_names_[static_cast<size_t>(rank_)] = name_;
  const int fd = ::shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw OdcError(sysError(me + ": shm_open " + name_));
  names_to_unlink_.push_back(name_);
  if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    throw OdcError(sysError(me + ": ftruncate " + name_ + " to " + std::to_string(bytes_) +
                            " bytes (is /dev/shm large enough?)"));
  }
  void* base = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) throw OdcError(sysError(me + ": mmap " + name_));
  regions_.bases[rank_] = static_cast<uint8_t*>(base);
  own_ = std::shared_ptr<void>(base, [bytes = bytes_](void* p) { ::munmap(p, bytes); });
  pids_[rank_] = ::getpid();
  atomic64(regions_.bases[rank_] + layout.controlPid())->store(static_cast<uint64_t>(::getpid()));
  startLifeLock();  // held before any peer can map the region
  rdv.set(prefix + "/shm/name/" + std::to_string(rank_), name_);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const std::string peer_name = await(rdv, prefix, prefix + "/shm/name/" + std::to_string(r),
                                        "peer rank " + std::to_string(r) + "'s region name");
    mapPeer(r, token, peer_name);
  }
  rdv.set(prefix + "/shm/mapped/" + std::to_string(rank_), "1");
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    await(rdv, prefix, prefix + "/shm/mapped/" + std::to_string(r),
          "peer rank " + std::to_string(r) + " to map every region");
  }
}

void ShmTransport::mapPeer(int r, const std::string& token, const std::string& peer_name) {
  const std::string refuse = "odc: rank " + std::to_string(rank_) + ": refusing peer rank " +
                             std::to_string(r) + "'s shared-memory region '" + peer_name + "': ";
  const std::string advice = ". Only a region this job's rank " + std::to_string(r) +
                             " just created is mapped (a stale or spoofed segment?); attach again.";
  // The name must be the one rank r of this job creates: /odc-<token>-<pid>-r<r>.
  const std::string head = "/odc-" + token + "-";
  const std::string tail = "-r" + std::to_string(r);
  const bool shaped =
      peer_name.size() > head.size() + tail.size() &&
      peer_name.compare(0, head.size(), head) == 0 &&
      peer_name.compare(peer_name.size() - tail.size(), tail.size(), tail) == 0 &&
      peer_name.find_first_not_of("0123456789", head.size()) == peer_name.size() - tail.size();
  if (!shaped) throw OdcError(refuse + "not a name of this job (token " + token + ")" + advice);
  const int pfd = ::shm_open(peer_name.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (pfd < 0) throw OdcError(sysError(refuse + "shm_open"));
  struct stat st {};
  std::string problem;
  if (::fstat(pfd, &st) != 0) {
    problem = std::string("fstat: ") + std::strerror(errno);
  } else if (st.st_uid != ::geteuid()) {
    problem = "it is owned by uid " + std::to_string(st.st_uid) + ", not by this user (uid " +
              std::to_string(::geteuid()) + ")";
  } else if ((st.st_mode & 07777) != 0600) {
    char mode[16];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    problem = std::string("its mode is ") + mode + ", not 0600";
  } else if (!S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != bytes_) {
    problem = "it has " + std::to_string(st.st_size) + " bytes, not the " + std::to_string(bytes_) +
              " bytes of the attached layout";
  }
  if (!problem.empty()) {
    ::close(pfd);
    throw OdcError(refuse + problem + advice);
  }
  names_to_unlink_.push_back(peer_name);
  peer_names_.at(static_cast<size_t>(r)) = peer_name;
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
  ::close(pfd);
  if (p == MAP_FAILED) throw OdcError(sysError(refuse + "mmap"));
  regions_.bases[r] = static_cast<uint8_t*>(p);
  pids_[r] = static_cast<int>(atomic64(regions_.bases[r] + layout_.controlPid())->load());
}

void ShmTransport::unlinkKnownNames() {
  for (const auto& n : names_to_unlink_) ::shm_unlink(n.c_str());  // ENOENT: already unlinked
  names_to_unlink_.clear();
}

void ShmTransport::startLifeLock() {
  auto* life = reinterpret_cast<pthread_mutex_t*>(regions_.bases[rank_] + layout_.controlLife());
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int rc = pthread_mutex_init(life, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc != 0) {
    errno = rc;
    throw OdcError(sysError("odc: rank " + std::to_string(rank_) + ": life lock init"));
  }
  life_stop_ = false;
  life_locked_ = false;
  life_thread_ = std::thread([this, life] {
    pthread_mutex_lock(life);
    std::unique_lock<std::mutex> lock(life_mu_);
    life_locked_ = true;
    life_cv_.notify_all();
    life_cv_.wait(lock, [this] { return life_stop_; });
    // Returns holding `life`: the kernel marks it owner-dead, as when the process dies.
  });
  std::unique_lock<std::mutex> lock(life_mu_);
  life_cv_.wait(lock, [this] { return life_locked_; });
}

void ShmTransport::stopLifeLock() {
  if (!life_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(life_mu_);
    life_stop_ = true;
  }
  life_cv_.notify_all();
  life_thread_.join();
}

std::string ShmTransport::createAccumulators(uint64_t gen) {
  const std::string me = "odc: rank " + std::to_string(rank_);
  dropAccumulators();
  const std::string name = name_ + "-a" + std::to_string(gen);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw OdcError(sysError(me + ": shm_open " + name));
  acc_name_ = name;
  if (::ftruncate(fd, static_cast<off_t>(regions_.acc_bytes)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(name.c_str());
    acc_name_.clear();
    errno = err;
    throw OdcError(sysError(me + ": ftruncate " + name + " to " +
                            std::to_string(regions_.acc_bytes) +
                            " bytes of gradient accumulators (is /dev/shm large enough?)"));
  }
  void* base = ::mmap(nullptr, regions_.acc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(name.c_str());
    acc_name_.clear();
    throw OdcError(sysError(me + ": mmap " + name));
  }
  regions_.acc_bases[rank_] = static_cast<uint8_t*>(base);  // a new segment reads as zeros
  acc_own_ =
      std::shared_ptr<void>(base, [bytes = regions_.acc_bytes](void* p) { ::munmap(p, bytes); });
  return name;
}

void ShmTransport::openAccumulators(int peer, const std::string& blob) {
  const std::string refuse = "odc: rank " + std::to_string(rank_) + ": refusing peer rank " +
                             std::to_string(peer) + "'s gradient accumulators '" + blob + "': ";
  // The name the peer's createAccumulators makes: its (checked) region name, "-a", digits.
  const std::string head = peerName(peer) + "-a";
  if (blob.size() <= head.size() || blob.compare(0, head.size(), head) != 0 ||
      blob.find_first_not_of("0123456789", head.size()) != std::string::npos) {
    throw OdcError(refuse + "not a name that rank makes");
  }
  const int fd = ::shm_open(blob.c_str(), O_RDWR | O_NOFOLLOW, 0);
  if (fd < 0) throw OdcError(sysError(refuse + "shm_open"));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_uid != ::geteuid() || (st.st_mode & 07777) != 0600 ||
      !S_ISREG(st.st_mode) || static_cast<size_t>(st.st_size) != regions_.acc_bytes) {
    ::close(fd);
    throw OdcError(refuse + "not a 0600 segment of this user with " +
                   std::to_string(regions_.acc_bytes) + " bytes");
  }
  void* p = ::mmap(nullptr, regions_.acc_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) throw OdcError(sysError(refuse + "mmap"));
  if (regions_.acc_bases[peer]) ::munmap(regions_.acc_bases[peer], regions_.acc_bytes);
  regions_.acc_bases[peer] = static_cast<uint8_t*>(p);
}

void ShmTransport::accumulatorsOpened() {
  if (!acc_name_.empty()) ::shm_unlink(acc_name_.c_str());
  acc_name_.clear();
}

void ShmTransport::closePeerAccumulators() {
  for (int r = 0; r < static_cast<int>(regions_.acc_bases.size()); ++r) {
    if (r != rank_ && regions_.acc_bases[r]) ::munmap(regions_.acc_bases[r], regions_.acc_bytes);
    if (r != rank_) regions_.acc_bases[r] = nullptr;
  }
}

void ShmTransport::dropAccumulators() {
  accumulatorsOpened();
  if (!regions_.acc_bases.empty()) regions_.acc_bases[rank_] = nullptr;
  acc_own_.reset();  // unmapped here, or when the last gradient view is freed
}

void ShmTransport::close() {
  closePeerAccumulators();
  dropAccumulators();
  stopLifeLock();  // before unmapping: the kernel marks the life lock in the mapped region
  for (size_t r = 0; r < regions_.bases.size(); ++r) {
    if (regions_.bases[r] && static_cast<int>(r) != rank_) ::munmap(regions_.bases[r], bytes_);
    regions_.bases[r] = nullptr;
  }
  own_.reset();  // unmapped here, or when the last tensor viewing it is freed
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

void ShmTransport::readAs(int peer, size_t offset, void* dst, size_t numel, DType from, DType to,
                          Stream) {
  convertInto(dst, at(peer, offset), numel, from, to);
}

void ShmTransport::accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset,
                              uint64_t epoch, const void* src, size_t numel, DType dtype,
                              double scale, Stream) {
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
  const auto deadline = Clock::now() + timeout_;  // the op's: it runs synchronously on the CPU
  // Start at a rank-dependent block so concurrent pushers spread over the lock words.
  for (size_t i = 0; i < blocks; ++i) {
    const size_t b = first_block + (i + static_cast<size_t>(rank_)) % blocks;
    const size_t begin = std::max(elem, b * kBlock);
    const size_t n = std::min(elem + numel, (b + 1) * kBlock) - begin;
    auto* lock = atomic32(at(peer, locks_offset + b * sizeof(uint32_t)));
    lockBlock(lock, peer, locks_offset, b, epoch, deadline);
    accumulateCpu(acc + begin * acc_size, s + (begin - elem) * src_size, n, dtype, scale);
    lock->store(0, std::memory_order_release);
  }
}

std::string ShmTransport::keyOfLocks(size_t locks_offset) const {
  for (size_t k = 0; k < layout_.numKeys(); ++k) {
    if (layout_.offsets(k).first_lock == locks_offset) return layout_.key(k).name;
  }
  return "?";
}

void ShmTransport::lockBlock(std::atomic<uint32_t>* lock, int owner, size_t locks_offset,
                             size_t block, uint64_t epoch, Clock::time_point deadline) {
  const uint32_t me = static_cast<uint32_t>(rank_) + 1;
  uint32_t expected = 0;
  int spins = 0;
  auto next_liveness = Clock::now();
  while (!lock->compare_exchange_weak(expected, me, std::memory_order_acquire,
                                      std::memory_order_relaxed)) {
    const uint32_t holder = expected;
    expected = 0;
    if (++spins <= 64) continue;
    std::this_thread::yield();
    const auto now = Clock::now();
    if (holder == 0 || now < next_liveness) continue;
    next_liveness = now + std::chrono::milliseconds(5);
    const int holder_rank = static_cast<int>(holder) - 1;
    const auto what = [&] {
      return "the accumulation lock of block " + std::to_string(block) + " of key '" +
             keyOfLocks(locks_offset) + "' in rank " + std::to_string(owner) +
             "'s accumulator (minibatch " + std::to_string(epoch) + "), held by peer rank " +
             std::to_string(holder_rank);
    };
    if (holder_rank >= 0 && holder_rank < world_ && !peerAlive(holder_rank)) {
      // Never taken over: the holder may have added part of its block.
      throw OdcError("odc: rank " + std::to_string(rank_) + ": the peer process exited holding " +
                     what() + ". That block may be half-added, so minibatch " +
                     std::to_string(epoch) +
                     " cannot complete: restart the job from its last checkpoint.");
    }
    if (now >= deadline) {
      throw OdcTimeout("odc: rank " + std::to_string(rank_) + " timed out after " +
                       std::to_string(timeout_.count() / 1000.0) + " s waiting for " + what() +
                       ": is that rank stuck?");
    }
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
  uint8_t* base = regions_.bases.at(static_cast<size_t>(peer));
  if (peer == rank_) return true;
  if (dead_[peer].load(std::memory_order_relaxed)) return false;
  if (!base) return true;  // not mapped yet: nothing known
  auto* life = reinterpret_cast<pthread_mutex_t*>(base + layout_.controlLife());
  const int rc = pthread_mutex_trylock(life);
  if (rc == EBUSY) return true;  // its owner holds it: alive
  // EOWNERDEAD: we now hold a dead owner's lock. Unlocked without pthread_mutex_consistent it
  // becomes unrecoverable, so every other peer sees ENOTRECOVERABLE: dead, never "busy".
  if (rc == EOWNERDEAD || rc == 0) pthread_mutex_unlock(life);
  dead_[peer].store(true, std::memory_order_relaxed);
  return false;
}

}  // namespace torch_odc
