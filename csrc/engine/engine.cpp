#include "engine/engine.h"

#include <algorithm>

#include "engine/wait.h"

namespace torch_odc {

namespace {

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// First key where two digests differ, for an error a user can act on.
std::vector<std::string> splitKeys(const std::string& digest) {
  std::vector<std::string> out;
  size_t start = 0;
  for (size_t end; (end = digest.find(';', start)) != std::string::npos; start = end + 1) {
    out.push_back(digest.substr(start, end - start));
  }
  return out;
}

std::string firstDifference(const std::string& a, const std::string& b) {
  const auto ka = splitKeys(a), kb = splitKeys(b);
  for (size_t i = 0; i < std::max(ka.size(), kb.size()); ++i) {
    const std::string x = i < ka.size() ? ka[i] : "<missing>";
    const std::string y = i < kb.size() ? kb[i] : "<missing>";
    if (x != y) return "'" + x + "' vs '" + y + "'";
  }
  return "(none)";
}

}  // namespace

void EngineStats::add(const EngineStats& o) {
  keyed_gathers += o.keyed_gathers;
  keyed_reduce_scatters += o.keyed_reduce_scatters;
  publishes += o.publishes;
  bytes_fetched += o.bytes_fetched;
  bytes_pushed += o.bytes_pushed;
  publish_wait_s += o.publish_wait_s;
  barrier_s += o.barrier_s;
  minibatches += o.minibatches;
}

Engine::Engine(int rank, int world, std::chrono::milliseconds timeout,
               std::unique_ptr<Transport> transport)
    : rank_(rank), world_(world), timeout_(timeout), transport_(std::move(transport)) {
  if (world_ < 1 || rank_ < 0 || rank_ >= world_) {
    throw OdcError("odc: invalid rank " + std::to_string(rank_) + " of " + std::to_string(world_));
  }
}

Engine::~Engine() { close(); }

void Engine::close() {
  std::lock_guard<std::mutex> lock(mu_);
  if (transport_) transport_->close();
  connected_ = false;
}

void Engine::connect(Rendezvous& rdv, const std::string& prefix, std::vector<KeySpec> keys) {
  std::lock_guard<std::mutex> lock(mu_);
  if (connected_)
    throw OdcError("odc: rank " + std::to_string(rank_) + ": engine already connected");
  RegionLayout layout(std::move(keys));
  const std::string digest = layout.digest();
  rdv.set(prefix + "/digest/" + std::to_string(rank_), digest);
  for (int r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    const std::string other = rdv.get(prefix + "/digest/" + std::to_string(r), timeout_);
    if (other != digest) {
      throw OdcError("odc: rank " + std::to_string(rank_) + " and rank " + std::to_string(r) +
                     " attached different models (first difference, name:shard numel:dtype:"
                     "accum numel:dtype: " +
                     firstDifference(digest, other) +
                     "). Every rank must attach the same FSDP2 model.");
    }
  }
  transport_->connect(rdv, prefix, layout, timeout_);
  layout_ = std::move(layout);
  published_.assign(layout_.numKeys(), 0);
  connected_ = true;
}

size_t Engine::keyIndex(const std::string& name) const {
  for (size_t k = 0; k < layout_.numKeys(); ++k) {
    if (layout_.key(k).name == name) return k;
  }
  throw OdcError("odc: rank " + std::to_string(rank_) + ": unknown key '" + name + "'");
}

std::string Engine::where(size_t key) const {
  return "key '" + layout_.key(key).name + "' (minibatch " + std::to_string(epoch_) + ")";
}

void Engine::checkKey(size_t key, const char* op) const {
  if (!connected_) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": " + op +
                   " before torch_odc.attach() connected the engine");
  }
  if (key >= layout_.numKeys()) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": " + op + " with unknown key #" +
                   std::to_string(key));
  }
  if (arrived_) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": " + op + " on " + where(key) +
                   " inside the minibatch barrier");
  }
}

WaitContext Engine::context(std::function<std::string()> describe) const {
  return WaitContext{Clock::now() + timeout_, std::move(describe)};
}

void Engine::publishLocked(size_t key, const void* in, size_t in_bytes, DType dtype,
                           Stream stream) {
  const auto& spec = layout_.key(key);
  if (in_bytes != spec.shardBytes() || dtype != spec.gather_dtype) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": all-gather of " + where(key) +
                   " got an input of " + std::to_string(in_bytes) + " bytes of " +
                   dtypeName(dtype) + ", but the key was attached with " +
                   std::to_string(spec.shardBytes()) + " bytes of " + dtypeName(spec.gather_dtype));
  }
  if (published_[key] == epoch_) return;
  const auto& off = layout_.offsets(key);
  transport_->writeLocal(off.cache, in, in_bytes, stream);
  transport_->publish(off.published_flag, epoch_, stream);
  published_[key] = epoch_;
  ++current_.publishes;
}

void Engine::publish(size_t key, const void* in, size_t in_bytes, DType dtype, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  checkKey(key, "publish");
  publishLocked(key, in, in_bytes, dtype, stream);
}

void Engine::gather(size_t key, void* out, const void* in, size_t in_bytes, size_t out_bytes,
                    DType dtype, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  checkKey(key, "all-gather");
  if (out_bytes != in_bytes * static_cast<size_t>(world_)) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": all-gather of " + where(key) +
                   ": output has " + std::to_string(out_bytes) + " bytes, expected world size " +
                   std::to_string(world_) + " x " + std::to_string(in_bytes));
  }
  publishLocked(key, in, in_bytes, dtype, stream);
  ++current_.keyed_gathers;
  const auto& off = layout_.offsets(key);
  auto* out_bytes_ptr = static_cast<uint8_t*>(out);
  uint8_t* own = out_bytes_ptr + static_cast<size_t>(rank_) * in_bytes;
  if (own != in) {
    // FSDP2 passes a view of the output's own chunk; anything else is copied from the cache.
    transport_->read(rank_, off.cache, own, in_bytes, stream);
  }
  // Peers in rotated order, so that no owner is read by every rank at once.
  std::vector<Transport::PeerRead> reads;
  reads.reserve(static_cast<size_t>(world_ - 1));
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    reads.push_back(
        {peer, out_bytes_ptr + static_cast<size_t>(peer) * in_bytes, context([this, peer, key] {
           return "peer rank " + std::to_string(peer) + " to publish " + where(key) +
                  ". The peer has not run this module's all-gather in this "
                  "minibatch: is it stuck, or did it skip "
                  "torch_odc.minibatch_barrier()?";
         })});
    current_.bytes_fetched += in_bytes;
  }
  current_.publish_wait_s +=
      transport_->gatherPeers(off.cache, off.published_flag, epoch_, in_bytes, reads, stream);
  transport_->endOp(stream);
}

void Engine::push(size_t key, const void* in, size_t in_numel, DType dtype, double scale,
                  Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  checkKey(key, "reduce-scatter");
  const auto& spec = layout_.key(key);
  if (dtype != spec.reduce_dtype || in_numel != spec.accum_numel * static_cast<size_t>(world_)) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": reduce-scatter of " + where(key) +
                   " got " + std::to_string(in_numel) + " elements of " + dtypeName(dtype) +
                   ", but the key was attached with world size " + std::to_string(world_) + " x " +
                   std::to_string(spec.accum_numel) + " elements of " +
                   dtypeName(spec.reduce_dtype));
  }
  ++current_.keyed_reduce_scatters;
  const auto& off = layout_.offsets(key);
  const size_t chunk_bytes = spec.accumBytes();
  std::vector<Transport::PeerPush> pushes;
  pushes.reserve(static_cast<size_t>(world_));
  for (int i = 0; i < world_; ++i) {  // rotated, the own chunk first
    const int owner = (rank_ + i) % world_;
    pushes.push_back(
        {owner, static_cast<const uint8_t*>(in) + static_cast<size_t>(owner) * chunk_bytes});
    if (owner != rank_) current_.bytes_pushed += chunk_bytes;
  }
  transport_->pushPeers(off.accum, off.first_lock, off.pushed_flag, epoch_, spec.accum_numel, dtype,
                        scale, pushes, stream);
  transport_->endOp(stream);
}

bool Engine::publishedThisEpoch(size_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return key < published_.size() && published_[key] == epoch_;
}

void Engine::waitAll(size_t control_offset, const char* phase) {
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    const auto ctx = context([this, peer, phase] {
      return "peer rank " + std::to_string(peer) + " to " + phase +
             " the minibatch barrier of "
             "minibatch " +
             std::to_string(epoch_) +
             ". Every rank must call "
             "torch_odc.minibatch_barrier() once per minibatch.";
    });
    hostWait([&] { return transport_->loadControl(peer, control_offset) >= epoch_; },
             [&] { return transport_->peerAlive(peer); }, ctx,
             ("odc: rank " + std::to_string(rank_)).c_str());
  }
}

void Engine::arrive(Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!connected_) throw OdcError("odc: rank " + std::to_string(rank_) + ": barrier before attach");
  if (arrived_) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": minibatch barrier of minibatch " +
                   std::to_string(epoch_) + " entered twice");
  }
  const auto t0 = Clock::now();
  for (size_t k = 0; k < layout_.numKeys(); ++k) {
    if (published_[k] != epoch_) {
      throw OdcError("odc: rank " + std::to_string(rank_) + ": barrier of minibatch " +
                     std::to_string(epoch_) + " reached before key '" + layout_.key(k).name +
                     "' was published; publish every key first (torch_odc.minibatch_barrier "
                     "does)");
    }
  }
  transport_->quiesce(stream);  // every push of this rank has landed
  transport_->storeControl(layout_.controlArrived(), epoch_);
  arrived_ = true;
  waitAll(layout_.controlArrived(), "arrive at");
  current_.barrier_s += secondsSince(t0);
}

bool Engine::pushedThisEpoch(size_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  return transport_->loadLocalFlag(layout_.offsets(key).pushed_flag) == epoch_;
}

void* Engine::accumulator(size_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  return transport_->localPointer(layout_.offsets(key).accum);
}

void Engine::release(Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!arrived_) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": barrier release of minibatch " +
                   std::to_string(epoch_) + " without arrive");
  }
  const auto t0 = Clock::now();
  for (size_t k = 0; k < layout_.numKeys(); ++k) {
    const auto& off = layout_.offsets(k);
    transport_->zeroLocal(off.accum, layout_.key(k).accumBytes(), stream);
  }
  transport_->quiesce(stream);
  transport_->storeControl(layout_.controlReleased(), epoch_);
  waitAll(layout_.controlReleased(), "leave");
  current_.barrier_s += secondsSince(t0);
  current_.minibatches = 1;
  last_ = current_;
  total_.add(current_);
  current_ = EngineStats{};
  arrived_ = false;
  ++epoch_;
}

EngineStats Engine::lastStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_;
}

EngineStats Engine::totalStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return total_;
}

EngineStats Engine::currentStats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

}  // namespace torch_odc
