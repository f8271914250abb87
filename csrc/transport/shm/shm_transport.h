// Shared-memory transport for CPU tensors on one host.
//
// Each rank creates one POSIX shared-memory region (mode 0600, a name unique to the job),
// publishes its name through the rendezvous, and maps every peer's region. Once every rank has
// mapped every region, each rank unlinks its own name: the memory lives exactly as long as some
// process maps it, so nothing is left in /dev/shm after a crash.
//
// Reads are memcpy from a peer's mapping; flags are 64-bit atomics (release on publish, acquire
// on wait); accumulation takes a per-block spinlock word in the owner's region, so concurrent
// pushers into one accumulator never lose an update.
#pragma once

#include <string>
#include <vector>

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
  void accumulate(int peer, size_t accum_offset, size_t elem, size_t locks_offset, const void* src,
                  size_t numel, DType dtype, double scale, Stream stream) override;
  void quiesce(Stream stream) override;

  void storeControl(size_t offset, uint64_t value) override;
  uint64_t loadControl(int peer, size_t offset) override;
  void* localPointer(size_t offset) override;
  void zeroLocal(size_t offset, size_t bytes, Stream stream) override;
  bool peerAlive(int peer) override;

  const std::string& regionName() const { return name_; }

 private:
  uint8_t* at(int peer, size_t offset) const;

  const int rank_;
  const int world_;
  size_t bytes_ = 0;
  std::string name_;
  std::vector<uint8_t*> bases_;  // index = rank; bases_[rank_] is the own region
  std::vector<int> pids_;
};

// Adds scale * src into dst elementwise, for the reduce dtypes (float math, rounded once).
// dst[i] += scale * src[i]: dst in accumDtypeFor(dtype), src in dtype.
void accumulateCpu(void* dst, const void* src, size_t numel, DType dtype, double scale);

}  // namespace torch_odc
