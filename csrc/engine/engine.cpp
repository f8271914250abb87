#include "engine/engine.h"

#include <algorithm>
#include <cstring>

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
  barrier_wait_s += o.barrier_wait_s;
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
  gather_waited_.assign(layout_.numKeys(), 0);
  gather_stream_.assign(layout_.numKeys(), nullptr);
  pushed_bits_.assign(layout_.pushedBitWords(), 0);
  peer_bits_.assign(layout_.pushedBitWords(), 0);
  op_names_.clear();
  for (size_t k = 0; k < layout_.numKeys(); ++k) {
    const auto& name = layout_.key(k).name;
    op_names_.push_back({"odc::gather " + name, "odc::publish " + name, "odc::push " + name});
  }
  all_params_.assign(layout_.numKeys(), {});
  all_runs_.assign(layout_.numKeys(), {});
  all_chunk_.assign(layout_.numKeys(), 0);
  for (size_t k = 0; k < layout_.numKeys(); ++k) {
    const auto& spec = layout_.key(k);
    const auto& off = layout_.offsets(k);
    size_t chunk = 0;
    for (uint32_t p = 0; p < spec.grad_numels.size(); ++p) {
      const size_t numel = spec.grad_numels[p];
      if (numel == 0) continue;
      all_params_[k].push_back(p);
      auto& runs = all_runs_[k];
      if (!runs.empty() && runs.back().dst + runs.back().numel == off.param_accum[p]) {
        runs.back().numel += numel;
      } else {
        runs.push_back({off.param_accum[p], chunk, numel});
      }
      chunk += numel;
    }
    all_chunk_[k] = chunk;
  }
  reads_.reserve(static_cast<size_t>(world_));
  pushes_.assign(static_cast<size_t>(world_), {});
  collectives_ = 0;
  accum_gen_ = 0;
  accum_resident_ = false;
  connected_ = true;
  try {
    restoreLocked();
  } catch (...) {
    connected_ = false;
    transport_->close();
    throw;
  }
}

void Engine::waitWord(size_t offset, uint64_t value, const std::string& what) {
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    const auto ctx = context([this, peer, &what] {
      return "peer rank " + std::to_string(peer) + " to " + what + " (minibatch " +
             std::to_string(epoch_) + ")";
    });
    hostWait([&] { return transport_->loadControl(peer, offset) >= value; },
             [&] { return transport_->peerAlive(peer); }, ctx,
             ("odc: rank " + std::to_string(rank_)).c_str());
  }
}

void Engine::freeAccumulators(Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!connected_) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": free_gradient_memory before attach");
  }
  freeLocked(stream);
}

void Engine::freeLocked(Stream stream) {
  if (!accum_resident_) return;
  if (current_.keyed_reduce_scatters > 0) {
    // Peers' pushes of this minibatch may sit in our accumulators, ours in theirs: dropping
    // them would lose gradients. Peers that wait for this rank are told by its closed word.
    transport_->storeControl(layout_.controlAccumClosed(), ~uint64_t{0});
    throw OdcError("odc: rank " + std::to_string(rank_) +
                   ": torch_odc.free_gradient_memory() in minibatch " + std::to_string(epoch_) +
                   " after this rank pushed gradients in it: free the gradient memory only "
                   "between the minibatch barrier (and the optimizer step) and the next "
                   "backward, on every rank");
  }
  const auto t0 = Clock::now();
  transport_->quiesce(stream);
  transport_->closePeerAccumulators();
  transport_->storeControl(layout_.controlAccumClosed(), accum_gen_);
  const auto t_wait = Clock::now();
  waitWord(layout_.controlAccumClosed(), accum_gen_,
           "free its gradient memory (torch_odc.free_gradient_memory(), every rank, between "
           "the barrier and the next backward)");
  gm_times_.free_wait_s += secondsSince(t_wait);
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    if (transport_->loadControl(peer, layout_.controlAccumClosed()) == ~uint64_t{0}) {
      // It still maps ours: keep them (its pushes may be in them); nothing can go on.
      throw OdcError("odc: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer) +
                     " refused torch_odc.free_gradient_memory() in "
                     "minibatch " +
                     std::to_string(epoch_) +
                     " (it had pushed gradients in it); this minibatch cannot complete");
    }
  }
  transport_->dropAccumulators();
  accum_resident_ = false;
  gm_times_.free_s += secondsSince(t0);
  ++gm_times_.frees;
}

void Engine::restoreAccumulators() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!connected_) {
    throw OdcError("odc: rank " + std::to_string(rank_) +
                   ": restore_gradient_memory before attach");
  }
  restoreLocked();
}

void Engine::restoreLocked() {
  if (accum_resident_) return;
  const uint64_t gen = accum_gen_ + 1;
  const auto t0 = Clock::now();
  std::string blob;
  try {
    blob = transport_->createAccumulators(gen);
  } catch (const OdcError&) {
    if (!alloc_retry_) throw;
    alloc_retry_();
    blob = transport_->createAccumulators(gen);
  }
  if (blob.size() > RegionLayout::kAccumBlobBytes) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": the " + transport_->name() +
                   " transport's accumulator description is " + std::to_string(blob.size()) +
                   " bytes long");
  }
  gm_times_.allocate_s += secondsSince(t0);
  const size_t words = (blob.size() + sizeof(uint64_t) - 1) / sizeof(uint64_t);
  std::string padded = blob;
  padded.resize(words * sizeof(uint64_t), '\0');
  const size_t at = layout_.controlAccumBlob();
  transport_->storeControl(at, blob.size());
  for (size_t w = 0; w < words; ++w) {
    uint64_t v = 0;
    std::memcpy(&v, padded.data() + w * sizeof(uint64_t), sizeof v);
    transport_->storeControl(at + (w + 1) * sizeof(uint64_t), v);
  }
  accum_gen_ = gen;
  transport_->storeControl(layout_.controlAccumGen(), gen);  // after the blob (release)
  auto t_wait = Clock::now();
  waitWord(layout_.controlAccumGen(), gen,
           "allocate its gradient memory (torch_odc.restore_gradient_memory(), or its first "
           "backward or barrier after torch_odc.free_gradient_memory())");
  gm_times_.restore_wait_s += secondsSince(t_wait);
  const auto t_open = Clock::now();
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    const size_t bytes = transport_->loadControl(peer, at);
    if (bytes > RegionLayout::kAccumBlobBytes) {
      throw OdcError("odc: rank " + std::to_string(rank_) + ": peer rank " + std::to_string(peer) +
                     " described its accumulators in " + std::to_string(bytes) + " bytes");
    }
    std::string theirs((bytes + sizeof(uint64_t) - 1) / sizeof(uint64_t) * sizeof(uint64_t), '\0');
    for (size_t w = 0; w * sizeof(uint64_t) < theirs.size(); ++w) {
      const uint64_t v = transport_->loadControl(peer, at + (w + 1) * sizeof(uint64_t));
      std::memcpy(theirs.data() + w * sizeof(uint64_t), &v, sizeof v);
    }
    theirs.resize(bytes);
    transport_->openAccumulators(peer, theirs);
  }
  gm_times_.open_s += secondsSince(t_open);
  // Nobody may allocate the next generation (overwriting its description) before every rank
  // mapped this one; then a transport may forget what named it.
  transport_->storeControl(layout_.controlAccumOpened(), gen);
  t_wait = Clock::now();
  waitWord(layout_.controlAccumOpened(), gen, "map every rank's gradient memory");
  gm_times_.restore_wait_s += secondsSince(t_wait);
  transport_->accumulatorsOpened();
  accum_resident_ = true;
  gm_times_.restore_s += secondsSince(t0);
  ++gm_times_.restores;
}

bool Engine::accumulatorsResident() const {
  std::lock_guard<std::mutex> lock(mu_);
  return accum_resident_;
}

GradientMemoryTimes Engine::gradientMemoryTimes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gm_times_;
}

uint64_t Engine::accumulatorGeneration() const {
  std::lock_guard<std::mutex> lock(mu_);
  return accum_gen_;
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
                   " after the minibatch barrier, before this rank released the minibatch's "
                   "gradients (torch_odc does at the next forward or keyed call)");
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
  if (spec.cacheDtype() != spec.gather_dtype) {
    // The cache holds the parameters in a wider dtype than the all-gather input: only their
    // owner's publish (publishWith, from the sharded parameters) can fill it.
    throw OdcError("odc: rank " + std::to_string(rank_) + ": all-gather of " + where(key) +
                   " before this rank published it: its shard cache holds " +
                   dtypeName(spec.cacheDtype()) + " parameters, which the " +
                   dtypeName(spec.gather_dtype) +
                   " all-gather input cannot fill (publish "
                   "through torch_odc.attach's hooks first)");
  }
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

std::vector<size_t> Engine::publishWith(const std::vector<size_t>& keys, const Fill& fill,
                                        Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<size_t> todo;
  for (const size_t key : keys) {
    checkKey(key, "publish");
    if (published_[key] != epoch_ && std::find(todo.begin(), todo.end(), key) == todo.end()) {
      todo.push_back(key);
    }
  }
  if (todo.empty()) return todo;
  // Peers read a cache only after its flag reached this epoch, and every read of the last
  // epoch completed before its reader arrived at the barrier: the caches are free to rewrite.
  std::vector<void*> caches;
  caches.reserve(todo.size());
  for (const size_t key : todo) {
    caches.push_back(transport_->localPointer(layout_.offsets(key).cache));
  }
  fill(todo, caches);
  // Flags lie kAlign apart in key order: one release over the range from the first to the last
  // key published here. A key in between was published earlier in this epoch (its flag
  // already holds this epoch: storing it again changes nothing) or is in `todo`.
  const auto [lo, hi] = std::minmax_element(todo.begin(), todo.end());
  transport_->publishFlags(layout_.offsets(*lo).published_flag, *hi - *lo + 1, RegionLayout::kAlign,
                           epoch_, stream);
  for (const size_t key : todo) published_[key] = epoch_;
  current_.publishes += todo.size();
  return todo;
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
  const size_t numel = layout_.key(key).shard_numel;
  if (own != in) {
    // FSDP2 passes a view of the output's own chunk; anything else is copied from the cache.
    transport_->readAs(rank_, off.cache, own, numel, layout_.key(key).cacheDtype(), dtype, stream);
  }
  // Peers in rotated order, so that no owner is read by every rank at once.
  const bool ready_known = gather_waited_[key] == epoch_ && gather_stream_[key] == stream;
  reads_.clear();
  const auto deadline = Clock::now() + timeout_;
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    // (peer, key) packed into one word: the closure fits std::function's inline buffer, so no
    // allocation per call; the text is built only when a wait fails.
    const uint64_t what = (static_cast<uint64_t>(key) << 16) | static_cast<uint64_t>(peer);
    reads_.push_back({peer, out_bytes_ptr + static_cast<size_t>(peer) * in_bytes,
                      WaitContext{deadline,
                                  [this, what] {
                                    const int p = static_cast<int>(what & 0xffff);
                                    return "peer rank " + std::to_string(p) + " to publish " +
                                           where(static_cast<size_t>(what >> 16)) +
                                           ". The peer has not run this module's all-gather in "
                                           "this minibatch: is it stuck, or did it skip "
                                           "torch_odc.minibatch_barrier()?";
                                  }},
                      ready_known});
    current_.bytes_fetched += layout_.key(key).cacheBytes();
  }
  current_.publish_wait_s +=
      transport_->gatherPeers(off.cache, off.published_flag, epoch_, numel,
                              layout_.key(key).cacheDtype(), dtype, reads_, stream);
  transport_->endOp(stream);
  gather_waited_[key] = epoch_;
  gather_stream_[key] = stream;
}

void Engine::push(size_t key, const void* in, size_t in_numel, DType dtype, double scale,
                  const std::vector<uint32_t>& params, Stream stream) {
  std::lock_guard<std::mutex> lock(mu_);
  checkKey(key, "reduce-scatter");
  const auto& spec = layout_.key(key);
  const auto& off = layout_.offsets(key);
  const auto fail = [&](const std::string& what) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": reduce-scatter of " + where(key) +
                   ": " + what);
  };
  if (accumDtypeFor(dtype) != spec.accum_dtype) {
    fail(std::string("pushes of ") + dtypeName(dtype) + " into a " + dtypeName(spec.accum_dtype) +
         " accumulator");
  }
  const size_t n = spec.grad_numels.size();
  // Spans in the input chunk (src) and the accumulator (dst), merged where both are contiguous.
  // A push of every trainable parameter in key order (the common case) uses the runs made at
  // connect; any other list is checked and merged here.
  const std::vector<uint32_t>* order = &all_params_[key];
  const std::vector<Run>* runs = &all_runs_[key];
  size_t chunk = all_chunk_[key];
  if (!params.empty() && params != all_params_[key]) {
    order = &params;
    runs = &runs_;
    runs_.clear();
    seen_.assign(n, 0);
    chunk = 0;
    for (const uint32_t p : params) {
      if (p >= n || seen_[p]) {
        fail("parameter #" + std::to_string(p) + " is out of range or listed twice");
      }
      seen_[p] = 1;
      const size_t numel = spec.grad_numels[p];
      if (numel == 0) {
        fail("parameter #" + std::to_string(p) +
             " was frozen (requires_grad=False) when the model was attached, so it has no "
             "accumulator; re-attach after changing requires_grad");
      }
      const size_t dst = off.param_accum[p];
      if (!runs_.empty() && runs_.back().dst + runs_.back().numel == dst) {
        runs_.back().numel += numel;
      } else {
        runs_.push_back({dst, chunk, numel});
      }
      chunk += numel;
    }
  }
  if (in_numel != chunk * static_cast<size_t>(world_)) {
    fail("got " + std::to_string(in_numel) + " elements, but its " + std::to_string(order->size()) +
         " parameters need world size " + std::to_string(world_) + " x " + std::to_string(chunk));
  }
  if (!accum_resident_) restoreLocked();  // the first push after free_gradient_memory()
  ++current_.keyed_reduce_scatters;
  waitOwnersReady(key, stream);
  const size_t esize = elementSize(dtype);
  for (const Run& run : *runs) {
    for (int i = 0; i < world_; ++i) {  // rotated, the own chunk first
      const int owner = (rank_ + i) % world_;
      pushes_[static_cast<size_t>(i)] = {
          owner,
          static_cast<const uint8_t*>(in) + (static_cast<size_t>(owner) * chunk + run.src) * esize};
    }
    transport_->pushPeers(off.accum, run.dst, off.first_lock, epoch_, run.numel, dtype, scale,
                          pushes_, stream);
  }
  current_.bytes_pushed += chunk * esize * static_cast<size_t>(world_ - 1);
  for (const uint32_t p : *order) {
    const size_t bit = off.first_param + p;
    pushed_bits_[bit / 64] |= uint64_t{1} << (bit % 64);
  }
  transport_->endOp(stream);
}

void Engine::waitOwnersReady(size_t key, Stream stream) {
  if (epoch_ == 1 || (ready_waited_ == epoch_ && ready_stream_ == stream)) return;
  // The own accumulators were zeroed on the stream the release ran on, which FSDP2's
  // reduce-scatter stream waits for before any reduce-scatter: only peers are waited for.
  reads_.clear();
  const auto deadline = Clock::now() + timeout_;
  for (int i = 1; i < world_; ++i) {
    const int peer = (rank_ + i) % world_;
    const uint64_t what = (static_cast<uint64_t>(key) << 16) | static_cast<uint64_t>(peer);
    reads_.push_back({peer, nullptr, WaitContext{deadline, [this, what] {
                                                   const size_t k = what >> 16;
                                                   return "peer rank " +
                                                          std::to_string(what & 0xffff) +
                                                          " to release its gradients of "
                                                          "minibatch " +
                                                          std::to_string(epoch_ - 1) +
                                                          " before the first push of " + where(k) +
                                                          ". The peer releases them when it "
                                                          "enters the next minibatch (its first "
                                                          "forward, or "
                                                          "torch_odc.minibatch_barrier()), after "
                                                          "its optimizer step: is it stuck, or "
                                                          "did it stop training?";
                                                 }}});
  }
  transport_->gatherPeers(0, layout_.readyFlag(), epoch_ - 1, 0, DType::kByte, DType::kByte, reads_,
                          stream);
  transport_->endOp(stream);
  ready_waited_ = epoch_;
  ready_stream_ = stream;
}

void Engine::noteCollective(const std::string& op) {
  {
    std::lock_guard<std::mutex> lock(op_mu_);
    last_collective_ = op;
  }
  // Only this thread of this process writes the word; peers read it with acquire.
  transport_->storeControl(layout_.controlCollectives(), ++collectives_);
}

bool Engine::publishedThisEpoch(size_t key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return key < published_.size() && published_[key] == epoch_;
}

std::string Engine::collectivesMismatch(int peer, uint64_t mine, uint64_t theirs) const {
  std::string last;
  {
    std::lock_guard<std::mutex> lock(op_mu_);
    last = last_collective_.empty() ? "none" : last_collective_;
  }
  return "odc: rank " + std::to_string(rank_) + ": in minibatch " + std::to_string(epoch_) +
         " ranks ran different numbers of collectives besides FSDP2's keyed all-gathers and "
         "reduce-scatters: " +
         std::to_string(mine) + " on this rank (the last: " + last + "), " +
         std::to_string(theirs) + " on peer rank " + std::to_string(peer) +
         " (counted since attach). A collective inside the microbatch loop (a per-microbatch "
         "loss or metric all-reduce) hangs or pairs up wrongly once ranks run different numbers "
         "of microbatches: run it once per minibatch, after torch_odc.minibatch_barrier().";
}

void Engine::waitAll(size_t control_offset, const char* phase, bool check_collectives) {
  const uint64_t mine = collectives_.load();
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
    hostWait(
        [&] {
          if (transport_->loadControl(peer, control_offset) >= epoch_) return true;
          // A peer that has run more collectives than this rank, which waits here and runs none,
          // is blocked in one that this rank will never join: say so now, not at the timeout.
          const uint64_t theirs = transport_->loadControl(peer, layout_.controlCollectives());
          if (check_collectives && theirs > mine) {
            throw OdcError(collectivesMismatch(peer, mine, theirs));
          }
          return false;
        },
        [&] { return transport_->peerAlive(peer); }, ctx,
        ("odc: rank " + std::to_string(rank_)).c_str());
  }
}

void Engine::arrive(Stream stream, const std::function<void(Phase, bool)>& trace) {
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
  if (!accum_resident_) restoreLocked();  // a rank that pushed nothing since the free
  if (trace) trace(Phase::kArriveWaitDevice, true);
  const auto t_device = Clock::now();
  transport_->quiesce(stream);  // every push of this rank has landed
  double waited = secondsSince(t_device);
  if (trace) trace(Phase::kArriveWaitDevice, false);
  const uint64_t arrived_with = collectives_.load();
  transport_->storeControl(layout_.controlArrivalCollectives(epoch_), arrived_with);
  for (size_t w = 0; w < pushed_bits_.size(); ++w) {
    transport_->storeControl(layout_.controlPushedBits(epoch_) + w * sizeof(uint64_t),
                             pushed_bits_[w]);
  }
  transport_->storeControl(layout_.controlArrived(), epoch_);
  arrived_ = true;
  if (trace) trace(Phase::kArriveWaitPeers, true);
  const auto t_peers = Clock::now();
  waitAll(layout_.controlArrived(), "arrive at", /*check_collectives=*/true);
  waited += secondsSince(t_peers);
  if (trace) trace(Phase::kArriveWaitPeers, false);
  // Every rank has arrived: the counts they arrived with are what they ran in this minibatch
  // (a peer may already run collectives of the next one: its live count is not compared).
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    const uint64_t theirs =
        transport_->loadControl(peer, layout_.controlArrivalCollectives(epoch_));
    if (theirs != arrived_with) throw OdcError(collectivesMismatch(peer, arrived_with, theirs));
  }
  peer_bits_ = pushed_bits_;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer == rank_) continue;
    for (size_t w = 0; w < peer_bits_.size(); ++w) {
      peer_bits_[w] |=
          transport_->loadControl(peer, layout_.controlPushedBits(epoch_) + w * sizeof(uint64_t));
    }
  }
  // The minibatch's work is over: its counters become "last".
  current_.barrier_s += secondsSince(t0);
  current_.barrier_wait_s += waited;
  current_.minibatches = 1;
  last_ = current_;
  total_.add(current_);
  current_ = EngineStats{};
}

std::vector<bool> Engine::gradParams(size_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!arrived_) {
    throw OdcError("odc: rank " + std::to_string(rank_) +
                   ": gradients are known only inside the minibatch barrier");
  }
  const auto& off = layout_.offsets(key);
  std::vector<bool> out(layout_.key(key).grad_numels.size());
  for (size_t p = 0; p < out.size(); ++p) {
    const size_t bit = off.first_param + p;
    out[p] = (peer_bits_[bit / 64] >> (bit % 64)) & 1;
  }
  return out;
}

void* Engine::accumulator(size_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!accum_resident_) {
    throw OdcError("odc: rank " + std::to_string(rank_) +
                   ": the gradient accumulators of "
                   "minibatch " +
                   std::to_string(epoch_) +
                   " were freed (torch_odc.free_gradient_memory()) and not restored yet");
  }
  return transport_->localPointer(layout_.offsets(key).accum);
}

void Engine::release(Stream stream, bool zero) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!arrived_) {
    throw OdcError("odc: rank " + std::to_string(rank_) + ": barrier release of minibatch " +
                   std::to_string(epoch_) + " without arrive");
  }
  // Freed accumulators come back zeroed: nothing to zero.
  if (zero && accum_resident_ && layout_.numKeys() > 0) {  // back to back: one zeroing
    const size_t first = layout_.offsets(0).accum;
    const size_t last = layout_.numKeys() - 1;
    transport_->zeroLocal(
        first, layout_.offsets(last).accum + layout_.key(last).accumBytes() - first, stream);
  }
  // Ordered after the zeroing (and whatever the caller ran on `stream` before: the optimizer
  // step); peers' first pushes of the next minibatch wait for it.
  transport_->publish(layout_.readyFlag(), epoch_, stream);
  // The next arrive writes its bitmap into the other parity's copy; peers read this one's.
  std::fill(pushed_bits_.begin(), pushed_bits_.end(), 0);
  arrived_ = false;
  ++epoch_;
}

bool Engine::arrived() const {
  std::lock_guard<std::mutex> lock(mu_);
  return arrived_;
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
