// Shared-memory transport for CPU tensors on one host.
//
// Each rank creates one POSIX shared-memory region (and one segment per generation of its
// accumulators, named after it and checked alike) (mode 0600, a name unique to the job),
// publishes its name through the rendezvous, and maps every peer's region. Once every rank has
// mapped every region, each rank unlinks its own name: the memory lives exactly as long as some
// process maps it, so nothing is left in /dev/shm after a crash.
//
// Before mapping a peer's region, its name must be the one this job's peer creates and the
// segment must be owned by this user, have mode 0600 and exactly the layout's size; anything else
// (a stale or spoofed segment) is refused with an error naming the peer. If attach fails on any
// rank, that rank posts the reason to the rendezvous, every rank waiting on it fails at once, and
// every rank unlinks every region name it knows: no segment is left in /dev/shm.
//
// Reads are memcpy from a peer's mapping; flags are 64-bit atomics (release on publish, acquire
// on wait); accumulation takes a per-block spinlock word in the owner's region, so concurrent
// pushers into one accumulator never lose an update. The lock word holds the holder's rank + 1:
// a waiter gives up at the operation's deadline, or as soon as the holder is known dead (then the
// block may be half-added and the minibatch cannot complete: the error says so, the lock is
// never taken over).
//
// Liveness: each rank holds a robust, process-shared mutex in its own control region (the life
// lock) from a thread of its own for as long as the transport is connected. When the process dies
// (SIGKILL included) or the transport closes, the kernel marks that mutex owner-dead; a peer's
// pthread_mutex_trylock then returns EOWNERDEAD (or ENOTRECOVERABLE once one peer saw it). No
// pids are compared, so this holds across PID namespaces and is immune to PID reuse; no
// heartbeat runs, so a starved process is never mistaken for a dead one (a hung one is caught by
// the deadline).
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/region_map.h"
#include "engine/transport.h"

namespace torch_odc {

class ShmTransport : public Transport {
 public:
  ShmTransport(int rank, int world);
  ~ShmTransport() override;

  const char* name() const override { return "shm"; }
  void connect(Rendezvous& rdv, const std::string& prefix, const RegionLayout& layout,
               std::chrono::milliseconds timeout) override;
  void close() override;

  void writeLocal(size_t offset, const void* src, size_t bytes, Stream stream) override;
  void publish(size_t flag_offset, uint64_t value, Stream stream) override;
  void waitFlag(int peer, size_t flag_offset, uint64_t value, const WaitContext& ctx,
                Stream stream) override;
  void read(int peer, size_t offset, void* dst, size_t bytes, Stream stream) override;
  void readAs(int peer, size_t offset, void* dst, size_t numel, DType from, DType to,
              Stream stream) override;
  std::shared_ptr<void> pinLocal() override { return own_; }
  std::string createAccumulators(uint64_t gen) override;
  void openAccumulators(int peer, const std::string& blob) override;
  void closePeerAccumulators() override;
  void dropAccumulators() override;
  void accumulatorsOpened() override;
  std::shared_ptr<void> pinAccumulators() override { return acc_own_; }
  void accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset, uint64_t epoch,
                  const void* src, size_t numel, DType dtype, double scale, Stream stream) override;
  void quiesce(Stream stream) override;

  void storeControl(size_t offset, uint64_t value) override;
  uint64_t loadControl(int peer, size_t offset) override;
  void* localPointer(size_t offset) override;
  void zeroLocal(size_t offset, size_t bytes, Stream stream) override;
  bool peerAlive(int peer) override;

  const std::string& regionName() const { return name_; }
  // The peer's pid as it reported it (in its own PID namespace), for messages only.
  int peerPid(int peer) const { return pids_.at(static_cast<size_t>(peer)); }

 private:
  uint8_t* at(int peer, size_t offset) const { return regions_.at(rank_, peer, offset); }
  void connectImpl(Rendezvous& rdv, const std::string& prefix, const RegionLayout& layout);
  // Waits for `key`; fails at once if some rank posted an attach failure, or at the timeout.
  std::string await(Rendezvous& rdv, const std::string& prefix, const std::string& key,
                    const std::string& what);
  // Opens and maps peer `r`'s region after checking its name, owner, mode and size.
  void mapPeer(int r, const std::string& token, const std::string& peer_name);
  void unlinkKnownNames();
  void startLifeLock();
  void stopLifeLock();
  // Takes an accumulation block lock (word = holder rank + 1) in `owner`'s region.
  void lockBlock(std::atomic<uint32_t>* lock, int owner, size_t locks_offset, size_t block,
                 uint64_t epoch, Clock::time_point deadline);
  std::string keyOfLocks(size_t locks_offset) const;

  const int rank_;
  const int world_;
  size_t bytes_ = 0;
  std::chrono::milliseconds timeout_{0};
  RegionLayout layout_;
  std::string name_;
  std::vector<std::string> peer_names_;  // every rank's checked region name
  const std::string& peerName(int peer) const { return peer_names_.at(static_cast<size_t>(peer)); }
  std::vector<std::string> names_to_unlink_;  // own and checked peers' names until unlinked
  // Every rank's region (regions_.bases[rank_] is the own one) and accumulators: one segment per
  // generation, named <region name>-a<gen>, unlinked once every rank mapped it (or when it is
  // dropped).
  RegionMap regions_;
  std::shared_ptr<void> own_;  // the own mapping: unmapped when close() and every pin dropped it
  std::shared_ptr<void> acc_own_;
  std::string acc_name_;  // the own segment's name while it is linked
  std::vector<int> pids_;
  std::unique_ptr<std::atomic<bool>[]> dead_;  // peers known dead (sticky)
  // The thread that holds this rank's life lock (see above) until close().
  std::thread life_thread_;
  std::mutex life_mu_;
  std::condition_variable life_cv_;
  bool life_locked_ = false;
  bool life_stop_ = false;
};

// Adds scale * src into dst elementwise, for the reduce dtypes (float math, rounded once).
// dst[i] += scale * src[i]: dst in accumDtypeFor(dtype), src in dtype.
void accumulateCpu(void* dst, const void* src, size_t numel, DType dtype, double scale);

}  // namespace torch_odc
