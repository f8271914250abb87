#include "backend/odc_backend.h"

#include <ATen/Functions.h>
#include <ATen/record_function.h>
#include <c10/core/impl/COW.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <optional>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "transport/shm/shm_transport.h"

#ifdef ODC_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <nvtx3/nvToolsExt.h>

#include "transport/cuda_ipc/cuda_ipc_transport.h"
#endif

namespace torch_odc {

namespace {

// One ODC operation as a range in the PyTorch profiler (record_function, user scope) and, in
// CUDA builds, in NVTX (Nsight Systems). The name is referenced, not copied: it must outlive the
// range (the engine's per-key names do; a temporary string is kept by the owning constructor).
class OpRange {
 public:
  explicit OpRange(const std::string& name) : name_(&name), rf_(at::RecordScope::USER_SCOPE) {
    begin();
  }
  explicit OpRange(const char* name)
      : owned_(name), name_(&owned_), rf_(at::RecordScope::USER_SCOPE) {
    begin();
  }
  ~OpRange() {
#ifdef ODC_WITH_CUDA
    nvtxRangePop();
#endif
  }
  OpRange(const OpRange&) = delete;
  OpRange& operator=(const OpRange&) = delete;

 private:
  void begin() {
    if (rf_.isActive()) rf_.before(std::string_view(*name_), c10::ArrayRef<const c10::IValue>{});
#ifdef ODC_WITH_CUDA
    nvtxRangePushA(name_->c_str());
#endif
  }
  std::string owned_;
  const std::string* name_;  // outlives rf_, which may keep a view of it
  at::RecordFunction rf_;
};

at::ScalarType scalarTypeOf(DType t) {
  switch (t) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kByte:
      return at::kByte;
  }
  return at::kByte;
}

}  // namespace

using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

OdcBackend::OdcBackend(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                       std::chrono::milliseconds timeout, BackendPtr cpu_backend,
                       BackendFactory cuda_factory)
    : c10d::Backend(rank, size),
      store_(std::move(store)),
      timeout_(timeout),
      cpu_(std::move(cpu_backend)),
      cuda_factory_(std::move(cuda_factory)) {
  TORCH_CHECK(cpu_, "odc: rank ", rank, ": an inner CPU (gloo) backend is required");
  init();
}

OdcBackend::~OdcBackend() = default;

void OdcBackend::checkAlive(const char* op) const {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!shutdown_, "odc: rank ", rank_, ": ", op,
              " called after the process group was shut down or aborted");
}

bool OdcBackend::isShutdown() const {
  std::lock_guard<std::mutex> lock(mu_);
  return shutdown_;
}

OdcBackend::BackendPtr OdcBackend::inner(c10::DeviceType device) {
  TORCH_CHECK(device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA, "odc: rank ",
              rank_, ": tensors on device type ", c10::DeviceTypeName(device),
              " are not supported (only cpu and cuda)");
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!shutdown_, "odc: rank ", rank_, ": ", c10::DeviceTypeName(device),
              " collective after the process group was shut down or aborted");
  if (device == c10::DeviceType::CPU) {
    return cpu_;
  }
  if (!cuda_) {
    TORCH_CHECK(cuda_factory_, "odc: rank ", rank_,
                ": a CUDA tensor was passed but this build or process has no CUDA backend");
    cuda_ = cuda_factory_();
    TORCH_CHECK(cuda_, "odc: rank ", rank_, ": the CUDA backend factory returned nothing");
    if (!getGroupUid().empty()) {
      cuda_->setGroupUid(getGroupUid() + ":odc-nccl");
    }
  }
  return cuda_;
}

bool OdcBackend::hasCuda() const {
  std::lock_guard<std::mutex> lock(mu_);
  return cuda_ || cuda_factory_;
}

OdcBackend::BackendPtr OdcBackend::route(c10::DeviceType device) {
  auto backend = inner(device);
  switch (coalescing_) {
    case Coalescing::kOff:
      break;
    case Coalescing::kPending:
      if (device == c10::DeviceType::CUDA) {
        backend->startCoalescing();
        coalescing_ = Coalescing::kCuda;
      } else {
        coalescing_ = Coalescing::kCpu;
      }
      break;
    case Coalescing::kCuda:
    case Coalescing::kCpu:
      TORCH_CHECK((coalescing_ == Coalescing::kCuda) == (device == c10::DeviceType::CUDA),
                  "odc: rank ", rank_,
                  ": a coalesced block mixes CPU and CUDA tensors; coalesce one device at a time");
      break;
  }
  return backend;
}

namespace {

// The Work of a coalesced block of CPU ops: complete when every op's Work is.
class CoalescedWork : public c10d::Work {
 public:
  CoalescedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : c10d::Work(rank, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override {
    for (auto& w : works_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }
  bool isSuccess() const override {
    for (const auto& w : works_) {
      if (!w->isSuccess()) {
        return false;
      }
    }
    return true;
  }
  std::exception_ptr exception() const override {
    for (const auto& w : works_) {
      if (auto e = w->exception()) {
        return e;
      }
    }
    return nullptr;
  }
  void synchronize() override {
    for (auto& w : works_) {
      w->synchronize();
    }
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& w : works_) {
      w->wait(timeout);
    }
    return true;
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

}  // namespace

void OdcBackend::startCoalescing() {
  TORCH_CHECK(coalescing_ == Coalescing::kOff, "odc: rank ", rank_,
              ": startCoalescing called while a coalesced block is already open");
  coalescing_ = Coalescing::kPending;
}

WorkPtr OdcBackend::endCoalescing() {
  const auto mode = coalescing_;
  coalescing_ = Coalescing::kOff;
  switch (mode) {
    case Coalescing::kOff:
      TORCH_CHECK(false, "odc: rank ", rank_, ": endCoalescing without startCoalescing");
    case Coalescing::kPending:
      return nullptr;  // nothing was issued, as ProcessGroupNCCL returns for an empty block
    case Coalescing::kCuda:
      return inner(c10::DeviceType::CUDA)->endCoalescing();
    case Coalescing::kCpu:
      break;
  }
  auto works = std::move(coalesced_cpu_works_);
  coalesced_cpu_works_.clear();
  return c10::make_intrusive<CoalescedWork>(rank_, std::move(works));
}

OdcBackend::BackendPtr OdcBackend::cudaBackendIfCreated() {
  std::lock_guard<std::mutex> lock(mu_);
  return cuda_;
}

c10::DeviceType OdcBackend::deviceOf(const std::vector<at::Tensor>& tensors, const char* op) const {
  TORCH_CHECK(!tensors.empty(), "odc: rank ", rank_, ": ", op, " got no tensors");
  const auto device = tensors.front().device().type();
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device().type() == device, "odc: rank ", rank_, ": ", op,
                " got tensors on different device types (", tensors.front().device(), " and ",
                t.device(), ")");
  }
  return device;
}

c10::DeviceType OdcBackend::deviceOf(const std::vector<std::vector<at::Tensor>>& lists,
                                     const char* op) const {
  for (const auto& list : lists) {
    if (!list.empty()) {
      return deviceOf(list, op);
    }
  }
  TORCH_CHECK(false, "odc: rank ", rank_, ": ", op, " got no tensors");
}

WorkPtr OdcBackend::broadcast(std::vector<at::Tensor>& tensors,
                              const c10d::BroadcastOptions& opts) {
  return forward(deviceOf(tensors, "broadcast"),
                 [&](c10d::Backend& b) { return b.broadcast(tensors, opts); });
}

WorkPtr OdcBackend::allreduce(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceOptions& opts) {
  return forward(deviceOf(tensors, "allreduce"),
                 [&](c10d::Backend& b) { return b.allreduce(tensors, opts); });
}

WorkPtr OdcBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) {
  return forward(deviceOf(tensors, "allreduce_sparse"),
                 [&](c10d::Backend& b) { return b.allreduce_sparse(tensors, opts); });
}

WorkPtr OdcBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                        const c10d::AllreduceCoalescedOptions& opts) {
  return forward(deviceOf(tensors, "allreduce_coalesced"),
                 [&](c10d::Backend& b) { return b.allreduce_coalesced(tensors, opts); });
}

WorkPtr OdcBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return forward(deviceOf(tensors, "reduce"),
                 [&](c10d::Backend& b) { return b.reduce(tensors, opts); });
}

WorkPtr OdcBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs, const c10d::AllgatherOptions& opts) {
  return forward(deviceOf(inputs, "allgather"),
                 [&](c10d::Backend& b) { return b.allgather(outputs, inputs, opts); });
}

WorkPtr OdcBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                    const c10d::AllgatherOptions& opts) {
  if (const auto& call = currentKeyedCall(); call.key >= 0) {
    const auto held = engine("keyed all-gather");
    OpRange range(held->opName(call.publish_only ? Engine::Op::kPublish : Engine::Op::kGather,
                               static_cast<size_t>(call.key)));
    keyedAllgather(*held, call.key, output, input, call.publish_only);
    return keyedWork(c10d::OpType::_ALLGATHER_BASE, output, input);
  }
  if (input.is_contiguous() && output.is_contiguous() && output.numel() == size_ * input.numel() &&
      (input.dim() == 0 || output.dim() != input.dim() ||
       output.sizes().slice(1) != input.sizes().slice(1))) {
    // all_gather_into_tensor takes any output holding world_size x input.numel() elements on
    // NCCL; Gloo wants the output shaped (world_size * input.size(0), *input.shape[1:]). Callers
    // that pick their code path by backend name (accelerate's gather: the flat output for every
    // backend but "gloo") rely on NCCL's rule: run contiguous tensors as flat views, which
    // fills the output exactly as NCCL does (CPU tensors, and CUDA tensors on a Gloo inner
    // backend: ranks sharing a GPU; to NCCL a flat view is the same buffer). Anything else goes
    // to the inner backend as is (and its checks).
    auto flat_output = output.view({output.numel()});
    auto flat_input = input.view({input.numel()});
    return forward(input.device().type(), [&](c10d::Backend& b) {
      return b._allgather_base(flat_output, flat_input, opts);
    });
  }
  return forward(input.device().type(),
                 [&](c10d::Backend& b) { return b._allgather_base(output, input, opts); });
}

namespace {

// Gloo serving CUDA tensors (ODC_CUDA_COLLECTIVES=gloo): its coalesced all-gathers have no CUDA
// path (they copy the tensors' device pointers as host memory: a SIGSEGV, pytorch/pytorch#152645),
// and functional collectives (DTensor.full_tensor(), a full state dict) use
// allgather_into_tensor_coalesced. Its single all-gathers do stage CUDA tensors through host
// memory, so the coalesced ones run as one of those per tensor.
bool glooOnCuda(c10d::Backend& b, c10::DeviceType device) {
  return device == c10::DeviceType::CUDA && b.getBackendName() == "gloo";
}

}  // namespace

WorkPtr OdcBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::AllgatherOptions& opts) {
  const auto device = deviceOf(inputs, "allgather_coalesced");
  return forward(device, [&](c10d::Backend& b) -> WorkPtr {
    if (!glooOnCuda(b, device)) return b.allgather_coalesced(outputs, inputs, opts);
    TORCH_CHECK(outputs.size() == inputs.size(), "odc: rank ", rank_, ": allgather_coalesced got ",
                outputs.size(), " output lists for ", inputs.size(), " inputs");
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::vector<std::vector<at::Tensor>> out{outputs[i]};
      std::vector<at::Tensor> in{inputs[i]};
      works.push_back(b.allgather(out, in, opts));
    }
    return c10::make_intrusive<CoalescedWork>(rank_, std::move(works));
  });
}

WorkPtr OdcBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  const auto device = deviceOf(inputs, "allgather_into_tensor_coalesced");
  return forward(device, [&](c10d::Backend& b) -> WorkPtr {
    if (!glooOnCuda(b, device)) return b.allgather_into_tensor_coalesced(outputs, inputs, opts);
    TORCH_CHECK(outputs.size() == inputs.size(), "odc: rank ", rank_,
                ": allgather_into_tensor_coalesced got ", outputs.size(), " outputs for ",
                inputs.size(), " inputs");
    std::vector<WorkPtr> works;
    for (size_t i = 0; i < inputs.size(); ++i) {
      auto& output = outputs[i];
      auto& input = inputs[i];
      if (output.is_contiguous() && input.is_contiguous() &&
          output.numel() == size_ * input.numel()) {
        // Flat views: the output's rank-ordered chunks are the inputs, whatever its shape (as
        // NCCL fills it); Gloo's all-gather wants each chunk shaped as the input.
        auto flat_output = output.view({output.numel()});
        auto flat_input = input.view({input.numel()});
        works.push_back(b._allgather_base(flat_output, flat_input, opts));
      } else {
        works.push_back(b._allgather_base(output, input, opts));
      }
    }
    return c10::make_intrusive<CoalescedWork>(rank_, std::move(works));
  });
}

WorkPtr OdcBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                           std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return forward(deviceOf(inputs, "gather"),
                 [&](c10d::Backend& b) { return b.gather(outputs, inputs, opts); });
}

WorkPtr OdcBackend::scatter(std::vector<at::Tensor>& outputs,
                            std::vector<std::vector<at::Tensor>>& inputs,
                            const c10d::ScatterOptions& opts) {
  return forward(deviceOf(outputs, "scatter"),
                 [&](c10d::Backend& b) { return b.scatter(outputs, inputs, opts); });
}

WorkPtr OdcBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ReduceScatterOptions& opts) {
  return forward(deviceOf(outputs, "reduce_scatter"),
                 [&](c10d::Backend& b) { return b.reduce_scatter(outputs, inputs, opts); });
}

WorkPtr OdcBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                         const c10d::ReduceScatterOptions& opts) {
  if (const auto& call = currentKeyedCall(); call.key >= 0) {
    const auto held = engine("keyed reduce-scatter");
    OpRange range(held->opName(Engine::Op::kPush, static_cast<size_t>(call.key)));
    keyedReduceScatter(*held, call.key, output, input, opts.reduceOp, call.params, call.scale);
    return keyedWork(c10d::OpType::_REDUCE_SCATTER_BASE, output, input);
  }
  return forward(input.device().type(),
                 [&](c10d::Backend& b) { return b._reduce_scatter_base(output, input, opts); });
}

WorkPtr OdcBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::ReduceScatterOptions& opts) {
  return forward(deviceOf(inputs, "reduce_scatter_tensor_coalesced"), [&](c10d::Backend& b) {
    return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}

WorkPtr OdcBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                  std::vector<int64_t>& output_split_sizes,
                                  std::vector<int64_t>& input_split_sizes,
                                  const c10d::AllToAllOptions& opts) {
  return forward(input.device().type(), [&](c10d::Backend& b) {
    return b.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  });
}

WorkPtr OdcBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::AllToAllOptions& opts) {
  return forward(deviceOf(inputs, "alltoall"),
                 [&](c10d::Backend& b) { return b.alltoall(outputs, inputs, opts); });
}

WorkPtr OdcBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return forward(deviceOf(tensors, "send"),
                 [&](c10d::Backend& b) { return b.send(tensors, dst_rank, tag); });
}

WorkPtr OdcBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return forward(deviceOf(tensors, "recv"),
                 [&](c10d::Backend& b) { return b.recv(tensors, src_rank, tag); });
}

WorkPtr OdcBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return forward(deviceOf(tensors, "recvAnysource"),
                 [&](c10d::Backend& b) { return b.recvAnysource(tensors, tag); });
}

WorkPtr OdcBackend::barrier(const c10d::BarrierOptions& opts) {
  // torch's c10d::barrier op hands a backend the device_ids but not the device it dispatched
  // on. dist.barrier(device_ids=[i]) puts the barrier on the process's accelerator
  // (torch._C._get_accelerator()): in a process with CUDA it goes through NCCL, so it also orders
  // the device streams as with backend="nccl"; in a process without CUDA it is a CPU barrier and
  // goes through Gloo, which ignores device_ids as backend="gloo" does. An explicit device (a
  // direct Backend.barrier call) decides by itself; every other barrier uses Gloo.
  bool on_cuda = false;
  if (opts.device.has_value()) {
    on_cuda = opts.device->is_cuda();
  } else if (!opts.device_ids.empty()) {
    on_cuda = hasCuda();
  }
  return forward(on_cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU,
                 [&](c10d::Backend& b) { return b.barrier(opts); });
}

void OdcBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  checkAlive("monitored_barrier");
  inner(c10::DeviceType::CPU)->monitoredBarrier(opts, wait_all_ranks);
}

void OdcBackend::setSequenceNumberForGroup() {
  inner(c10::DeviceType::CPU)->setSequenceNumberForGroup();
}

uint64_t OdcBackend::getSequenceNumberForGroup() {
  return inner(c10::DeviceType::CPU)->getSequenceNumberForGroup();
}

void OdcBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  inner(c10::DeviceType::CPU)->setTimeout(timeout);
  if (auto cuda = cudaBackendIfCreated()) {
    cuda->setTimeout(timeout);
  }
}

void OdcBackend::setGroupUid(const std::string& pg_uid) {
  c10d::Backend::setGroupUid(pg_uid);
  inner(c10::DeviceType::CPU)->setGroupUid(pg_uid + ":odc-gloo");
  if (auto cuda = cudaBackendIfCreated()) {
    cuda->setGroupUid(pg_uid + ":odc-nccl");
  }
}

// ---- on-demand mode ------------------------------------------------------------------------

KeyedCall& currentKeyedCall() {
  thread_local KeyedCall call;
  return call;
}

DType toOdcDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    case at::kDouble:
      return DType::kFloat64;
    case at::kByte:
      return DType::kByte;
    default:
      TORCH_CHECK(false, "odc: dtype ", t, " is not supported for on-demand communication");
  }
}

namespace {

// c10d::Store as the engine's rendezvous.
class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    store_->wait({key}, timeout);
    const auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  bool tryGet(const std::string& key, std::string& value) override {
    if (!store_->check({key})) return false;
    const auto v = store_->get(key);
    value.assign(v.begin(), v.end());
    return true;
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// Keyed operations on the CPU complete before they return.
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type), outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

#ifdef ODC_WITH_CUDA
// A keyed op enqueued on a CUDA stream: complete when its event is; wait() makes the caller's
// current stream wait for it (no host block), like ProcessGroupNCCL, and raises a device-side
// wait timeout of the engine it ran on. Holds the tensors and the backend until destroyed, so a
// wait() after detach or shutdown is safe (it then only orders the streams).
class CudaEventWork : public c10d::Work {
 public:
  CudaEventWork(int rank, c10d::OpType type, std::vector<at::Tensor> tensors, cudaStream_t stream,
                c10::intrusive_ptr<OdcBackend> backend, int generation)
      : c10d::Work(rank, type),
        tensors_(std::move(tensors)),
        backend_(std::move(backend)),
        generation_(generation) {
    event_.record(c10::cuda::getStreamFromExternal(stream, tensors_.front().device().index()));
  }
  bool isCompleted() override { return event_.query(); }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override {
    event_.block(c10::cuda::getCurrentCUDAStream(tensors_.front().device().index()));
    backend_->checkDeviceErrors(generation_);
    return true;
  }
  void synchronize() override { event_.synchronize(); }
  std::vector<at::Tensor> result() override { return {tensors_.front()}; }

 private:
  std::vector<at::Tensor> tensors_;
  at::cuda::CUDAEvent event_;
  c10::intrusive_ptr<OdcBackend> backend_;
  int generation_;
};
#endif

// Translates c10d errors of the engine into c10::Error with the same text.
template <typename F>
void engineCall(F&& f) {
  try {
    f();
  } catch (const OdcTimeout& e) {
    TORCH_CHECK(false, e.what());
  } catch (const OdcError& e) {
    TORCH_CHECK(false, e.what());
  }
}

}  // namespace

void OdcBackend::connectEngine(const std::vector<KeySpec>& keys, int device_index) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!shutdown_, "odc: rank ", rank_, ": attach after shutdown");
  TORCH_CHECK(!engine_, "odc: rank ", rank_,
              ": a model is already attached to this process group; detach it first");
  std::unique_ptr<Transport> transport;
  if (device_index < 0) {
    transport = std::make_unique<ShmTransport>(rank_, size_);
  } else {
#ifdef ODC_WITH_CUDA
    transport = std::make_unique<CudaIpcTransport>(rank_, size_, device_index);
#else
    TORCH_CHECK(false, "odc: rank ", rank_,
                ": this build of torch_odc has no CUDA transport "
                "(built without a CUDA toolkit matching torch); rebuild on a CUDA machine");
#endif
  }
  for (const auto& k : keys) {
    TORCH_CHECK(KeySpec::servable(k.cacheDtype(), k.gather_dtype), "odc: rank ", rank_, ": key '",
                k.name, "': a ", dtypeName(k.cacheDtype()), " shard cache cannot serve ",
                dtypeName(k.gather_dtype), " all-gathers");
  }
  {
    std::lock_guard<std::mutex> adopt(adopt_mu_);
    adopted_.clear();
  }
  auto engine = std::make_unique<Engine>(rank_, size_, timeout_, std::move(transport));
#ifdef ODC_WITH_CUDA
  // Accumulators come back after free_gradient_memory() into memory torch's caching allocator
  // may have cached meanwhile: a failed allocation returns the cache and tries once more.
  if (device_index >= 0) {
    engine->setAllocationRetry([] { c10::cuda::CUDACachingAllocator::emptyCache(); });
  }
#endif
  StoreRendezvous rdv(store_);
  engineCall(
      [&] { engine->connect(rdv, "odc/engine/" + std::to_string(engine_generation_++), keys); });
  engine_ = std::move(engine);
}

void OdcBackend::disconnectEngine() {
  std::lock_guard<std::mutex> lock(mu_);
  engine_.reset();
  std::lock_guard<std::mutex> adopt(adopt_mu_);
  adopted_.clear();  // parameters still living in the region keep its memory (their pins)
}

void OdcBackend::noteCollective(c10d::OpType type) {
  std::shared_ptr<Engine> eng;
  {
    std::lock_guard<std::mutex> lock(mu_);
    eng = engine_;
  }
  if (eng) eng->noteCollective(c10d::opTypeToString(type));
}

bool OdcBackend::hasEngine() const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_ != nullptr;
}

std::shared_ptr<Engine> OdcBackend::engine(const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(engine_, "odc: rank ", rank_, ": ", op,
              " needs a model attached with torch_odc.attach(model) on this process group");
  return engine_;
}

namespace {

// The stream the barrier's device work runs on: the current stream of the engine's device
// (where finalize reads the accumulators), or none on the CPU.
Stream barrierStream(Engine& eng) {
#ifdef ODC_WITH_CUDA
  if (const int dev = eng.transport().deviceIndex(); dev >= 0) {
    return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
  }
#endif
  (void)eng;
  return nullptr;
}

// Raises an error a device wait or the watchdog recorded (sticky), before any further op.
void checkTransportErrors(Engine& eng) {
#ifdef ODC_WITH_CUDA
  if (auto* t = dynamic_cast<CudaIpcTransport*>(&eng.transport())) t->checkDeviceErrors();
#else
  (void)eng;
#endif
}

}  // namespace

void OdcBackend::barrierArrive() {
  OpRange range("odc::barrier_arrive");
  const auto held = engine("minibatch barrier");
  auto& eng = *held;
  // The two waits inside, as ranges of their own: the time the host only waits (for this rank's
  // GPU work, then for the peers), apart from the barrier's own work.
  std::optional<OpRange> wait;
  engineCall([&] {
    eng.arrive(barrierStream(eng), [&](Engine::Phase phase, bool begin) {
      if (begin) {
        wait.emplace(phase == Engine::Phase::kArriveWaitDevice ? "odc::wait_device"
                                                               : "odc::wait_peers");
      } else {
        wait.reset();
      }
    });
  });
}

void OdcBackend::barrierRelease(bool zero) {
  OpRange range("odc::barrier_release");
  const auto held = engine("minibatch barrier");
  auto& eng = *held;
  engineCall([&] { eng.release(barrierStream(eng), zero); });
}

void OdcBackend::freeAccumulators() {
  OpRange range("odc::free_gradient_memory");
  const auto held = engine("free_gradient_memory");
  auto& eng = *held;
  engineCall([&] { eng.freeAccumulators(barrierStream(eng)); });
}

void OdcBackend::restoreAccumulators() {
  OpRange range("odc::restore_gradient_memory");
  const auto held = engine("restore_gradient_memory");
  auto& eng = *held;
  engineCall([&] { eng.restoreAccumulators(); });
}

std::string OdcBackend::cudaTransportProblem(int device_index) {
#ifdef ODC_WITH_CUDA
  StoreRendezvous rdv(store_);
  std::string problem;
  engineCall([&] {
    problem = CudaIpcTransport::supportProblem(
        rank_, size_, device_index, rdv, "odc/cuda-support/" + std::to_string(support_checks_++),
        timeout_);
  });
  return problem;
#else
  (void)device_index;
  return "this build of torch_odc has no CUDA transport";
#endif
}

void OdcBackend::keyedAllgather(Engine& eng, int key, at::Tensor& output, at::Tensor& input,
                                bool publish_only) {
  const Stream stream = keyedStream(eng, input, output, "all-gather", key);
  engineCall([&] { checkTransportErrors(eng); });
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous() &&
                  input.scalar_type() == output.scalar_type(),
              "odc: rank ", rank_, ": keyed all-gather needs contiguous tensors of one dtype");
  const auto dtype = toOdcDtype(input.scalar_type());
  const size_t in_bytes = input.numel() * input.element_size();
  engineCall([&] {
    if (publish_only) {
      eng.publish(static_cast<size_t>(key), input.data_ptr(), in_bytes, dtype, stream);
    } else {
      eng.gather(static_cast<size_t>(key), output.data_ptr(), input.data_ptr(), in_bytes,
                 output.numel() * output.element_size(), dtype, stream);
    }
  });
}

namespace {

// The factor a reduce op applies to each rank's contribution (SUM 1, AVG 1/world, PREMUL_SUM
// its factor); other ops are refused.
double reduceScale(const c10d::ReduceOp& op, int rank, int world, const std::string& name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return 1.0;
    case c10d::ReduceOp::AVG:
      return 1.0 / world;
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(s, "odc: PREMUL_SUM without a factor");
      return s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
    }
    default:
      TORCH_CHECK(false, "odc: rank ", rank, ": keyed reduce-scatter of key '", name,
                  "' supports SUM, AVG and PREMUL_SUM, not reduce op ", static_cast<int>(op.op_));
  }
  return 1.0;
}

}  // namespace

void OdcBackend::keyedReduceScatter(Engine& eng, int key, at::Tensor& output, at::Tensor& input,
                                    const c10d::ReduceOp& op, const std::vector<uint32_t>& params,
                                    double extra_scale) {
  const auto& name = eng.layout().key(static_cast<size_t>(key)).name;
  const Stream stream = keyedStream(eng, input, output, "reduce-scatter", key);
  engineCall([&] { checkTransportErrors(eng); });
  TORCH_CHECK(input.is_contiguous(), "odc: rank ", rank_,
              ": keyed reduce-scatter needs a contiguous input");
  TORCH_CHECK(output.numel() * size_ == input.numel(), "odc: rank ", rank_,
              ": keyed reduce-scatter of key '", name, "': output has ", output.numel(),
              " elements, input ", input.numel(), " (expected world size ", size_, " x output)");
  const double scale = reduceScale(op, rank_, size_, name);
  engineCall([&] {
    eng.push(static_cast<size_t>(key), input.data_ptr(), static_cast<size_t>(input.numel()),
             toOdcDtype(input.scalar_type()), scale * extra_scale, params, stream);
  });
  // The reduced shard arrives at the minibatch barrier; until then FSDP2 accumulates zeros
  // (into a gradient of the user's own, or a partial HSDP output). One memset on the stream,
  // without a dispatcher round per call.
  const size_t bytes = static_cast<size_t>(output.numel()) * output.element_size();
  if (!output.is_contiguous()) {
    output.zero_();
  } else if (output.is_cpu()) {
    if (bytes) std::memset(output.data_ptr(), 0, bytes);
  } else {
#ifdef ODC_WITH_CUDA
    if (bytes) {
      C10_CUDA_CHECK(
          cudaMemsetAsync(output.data_ptr(), 0, bytes, static_cast<cudaStream_t>(stream)));
    }
#else
    output.zero_();
#endif
  }
}

// Adds the host time of its scope to one of the backend's C++ host clocks.
class HostTimer {
 public:
  HostTimer(OdcBackend& backend, OdcBackend::HostOp op)
      : clock_(backend.cpp_host_ns_[static_cast<size_t>(op)]),
        t0_(std::chrono::steady_clock::now()) {}
  ~HostTimer() {
    clock_.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_)
            .count(),
        std::memory_order_relaxed);
  }
  HostTimer(const HostTimer&) = delete;
  HostTimer& operator=(const HostTimer&) = delete;

 private:
  std::atomic<int64_t>& clock_;
  std::chrono::steady_clock::time_point t0_;
};

WorkPtr OdcBackend::keyedAllgatherCall(int key, at::Tensor& output, at::Tensor& input,
                                       bool async_op) {
  HostTimer timer(*this, HostOp::kGather);
  const auto held = engine("keyed all-gather");
  OpRange range(held->opName(Engine::Op::kGather, static_cast<size_t>(key)));
  keyedAllgather(*held, key, output, input, /*publish_only=*/false);
  return async_op ? keyedWork(c10d::OpType::_ALLGATHER_BASE, output, input) : WorkPtr();
}

WorkPtr OdcBackend::keyedReduceScatterCall(int key, at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceOp& op,
                                           const std::vector<uint32_t>& params, double scale,
                                           bool async_op) {
  HostTimer timer(*this, HostOp::kPush);
  const auto held = engine("keyed reduce-scatter");
  OpRange range(held->opName(Engine::Op::kPush, static_cast<size_t>(key)));
  keyedReduceScatter(*held, key, output, input, op, params, scale);
  return async_op ? keyedWork(c10d::OpType::_REDUCE_SCATTER_BASE, output, input) : WorkPtr();
}

std::vector<size_t> OdcBackend::publishShards(const std::vector<int64_t>& keys,
                                              const std::vector<std::vector<at::Tensor>>& sources,
                                              bool place_only) {
  HostTimer timer(*this, HostOp::kPublish);
  OpRange range("odc::publish_shards");
  const auto held = engine("publish");
  auto& eng = *held;
  const auto& layout = eng.layout();
  TORCH_CHECK(keys.size() == sources.size(), "odc: rank ", rank_, ": publish of ", keys.size(),
              " keys with ", sources.size(), " source lists");
  const int device = eng.transport().deviceIndex();
  std::vector<size_t> index(layout.numKeys(), SIZE_MAX);  // key -> position in `keys`
  std::vector<size_t> wanted;
  for (size_t i = 0; i < keys.size(); ++i) {
    TORCH_CHECK(keys[i] >= 0 && static_cast<size_t>(keys[i]) < layout.numKeys(), "odc: rank ",
                rank_, ": publish of unknown key #", keys[i]);
    const auto k = static_cast<size_t>(keys[i]);
    const auto& spec = layout.key(k);
    size_t numel = 0;
    for (const auto& t : sources[i]) {
      const bool here =
          device < 0 ? t.device().is_cpu() : (t.device().is_cuda() && t.device().index() == device);
      TORCH_CHECK(here && t.is_contiguous() && t.is_floating_point(), "odc: rank ", rank_,
                  ": the shard of key '", spec.name, "' must be contiguous floating-point ",
                  "tensors on ", device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device),
                  ", got ", t.scalar_type(), " on ", t.device());
      numel += static_cast<size_t>(t.numel());
    }
    TORCH_CHECK(numel == spec.shard_numel, "odc: rank ", rank_, ": the shard of key '", spec.name,
                "' (minibatch ", eng.epoch(), ") has ", numel,
                " elements, but the key was attached with ", spec.shard_numel,
                " (were parameters replaced or resized after torch_odc.attach()? re-attach)");
    index[k] = i;
    wanted.push_back(k);
  }
  Stream stream = nullptr;
#ifdef ODC_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (device >= 0) {
    guard.emplace(static_cast<c10::DeviceIndex>(device));
    stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  }
#endif
  engineCall([&] { checkTransportErrors(eng); });
  std::vector<size_t> done;
  if (place_only) {
    std::vector<void*> caches;
    for (const size_t k : wanted) {
      caches.push_back(eng.transport().localPointer(layout.offsets(k).cache));
    }
    engineCall([&] { fillCaches(eng, wanted, caches, index, sources, stream); });
    return done;
  }
  engineCall([&] {
    done = eng.publishWith(
        wanted,
        [&](const std::vector<size_t>& todo, const std::vector<void*>& caches) {
          fillCaches(eng, todo, caches, index, sources, stream);
        },
        stream);
  });
  return done;
}

namespace {

// The context of a DataPtr into the own region: a pin of the region's memory (pinLocal).
void releasePin(void* ctx) { delete static_cast<std::shared_ptr<void>*>(ctx); }

c10::weak_intrusive_ptr<c10::StorageImpl> noStorage() {
  return c10::weak_intrusive_ptr<c10::StorageImpl>(c10::intrusive_ptr<c10::StorageImpl>());
}

}  // namespace

void OdcBackend::evictLocked(Adopted& slot, Stream stream) {
  auto impl = slot.storage.lock();
  slot.storage = noStorage();
  if (!impl || impl->data_ptr().get() != slot.at) return;
  // The parameter leaves the cache: memory of its own from its storage's allocator (on CUDA
  // the caching allocator, on the current stream), the bytes copied over on that stream.
  c10::Allocator* allocator = impl->allocator();
  TORCH_CHECK(allocator, "odc: rank ", rank_,
              ": a parameter living in the shard cache has no allocator to move it back to");
  c10::DataPtr fresh = allocator->allocate(slot.bytes);
  if (slot.bytes > 0) {
    if (impl->device_type() == c10::kCPU) {
      std::memcpy(fresh.get(), slot.at, slot.bytes);
    } else {
#ifdef ODC_WITH_CUDA
      C10_CUDA_CHECK(cudaMemcpyAsync(fresh.get(), slot.at, slot.bytes, cudaMemcpyDeviceToDevice,
                                     static_cast<cudaStream_t>(stream)));
#else
      TORCH_CHECK(false, "odc: a device parameter in a build without CUDA");
#endif
    }
  }
  impl->set_data_ptr_noswap(std::move(fresh));
}

void OdcBackend::fillCaches(Engine& eng, const std::vector<size_t>& todo,
                            const std::vector<void*>& caches, const std::vector<size_t>& index,
                            const std::vector<std::vector<at::Tensor>>& sources, Stream stream) {
  // Every source tensor of every key to fill, and its place in the key's cache (a view of the
  // region in the key's cache dtype): one multi-tensor copy, which also casts exactly as FSDP2's
  // own all-gather copy-in does where the cache holds the gather dtype. The cache views name
  // their device: from_blob would otherwise ask the driver where each pointer lives (one query
  // per tensor, ~150 per minibatch for a 16-layer model). FSDP2's shards are flat already and
  // are passed as they are. A source that lives in its place already is not copied.
  const auto& layout = eng.layout();
  const int device = eng.transport().deviceIndex();
  const c10::Device on = device >= 0
                             ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device))
                             : c10::Device(c10::kCPU);
  std::shared_ptr<void> pin = eng.transport().pinLocal();
  struct Adopt {
    at::Tensor source;
    void* at;
    size_t slot;
    size_t bytes;
  };
  std::vector<Adopt> adopt;
  std::vector<at::Tensor> dst, src;
  std::lock_guard<std::mutex> lock(adopt_mu_);
  if (adopted_.size() != layout.numParams()) adopted_.assign(layout.numParams(), Adopted{});
  for (size_t n = 0; n < todo.size(); ++n) {
    const auto& spec = layout.key(todo[n]);
    const DType cache = spec.cacheDtype();
    const auto options = at::TensorOptions().dtype(scalarTypeOf(cache)).device(on);
    const size_t first = layout.offsets(todo[n]).first_param;
    const auto& list = sources[index[todo[n]]];
    TORCH_CHECK(list.size() == spec.grad_numels.size(), "odc: rank ", rank_, ": the shard of key '",
                spec.name, "' came as ", list.size(), " tensors for its ", spec.grad_numels.size(),
                " parameters");
    auto* at_byte = static_cast<uint8_t*>(caches[n]);
    for (size_t i = 0; i < list.size(); ++i) {
      const auto& t = list[i];
      const size_t bytes = static_cast<size_t>(t.numel()) * elementSize(cache);
      if (t.numel() == 0) continue;
      void* here = at_byte;
      at_byte += bytes;
      if (t.data_ptr() == here) continue;  // the parameter lives in its place
      // Whatever lived here leaves first (its bytes are about to be overwritten): FSDP2
      // replaced the parameter's storage (lazy init's re-padding, _apply).
      evictLocked(adopted_[first + i], stream);
      dst.push_back(
          at::for_blob(here, {t.numel()}).options(options).target_device(on).make_tensor());
      src.push_back(t.dim() == 1 ? t : t.view({t.numel()}));
      const auto& storage = t.storage();
      if (pin && t.scalar_type() == scalarTypeOf(cache) && t.storage_offset() == 0 &&
          storage.nbytes() == bytes && storage.data_ptr().get() == t.data_ptr() &&
          storage.data_ptr().get_deleter() != &releasePin &&
          !c10::impl::cow::is_cow_data_ptr(storage.data_ptr())) {
        adopt.push_back({t, here, first + i, bytes});
      }
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  for (auto& a : adopt) {
    c10::StorageImpl* impl = a.source.storage().unsafeGetStorageImpl();
    c10::DataPtr old =
        impl->set_data_ptr(c10::DataPtr(a.at, new std::shared_ptr<void>(pin), &releasePin, on));
#ifdef ODC_WITH_CUDA
    // The copy above still reads the old block on this stream: no reuse before it completes.
    if (device >= 0) {
      c10::cuda::CUDACachingAllocator::recordStream(
          old, at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
    }
#endif
    adopted_[a.slot] = Adopted{a.source.storage().getWeakStorageImpl(), a.at, a.bytes};
  }
}

void OdcBackend::evictShards() {
  const auto held = engine("detach");
  Stream stream = nullptr;
#ifdef ODC_WITH_CUDA
  std::optional<c10::cuda::CUDAGuard> guard;
  if (const int device = held->transport().deviceIndex(); device >= 0) {
    guard.emplace(static_cast<c10::DeviceIndex>(device));
    stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  }
#endif
  std::lock_guard<std::mutex> lock(adopt_mu_);
  for (auto& slot : adopted_) evictLocked(slot, stream);
  adopted_.clear();
}

size_t OdcBackend::adoptedBytes() {
  std::lock_guard<std::mutex> lock(adopt_mu_);
  size_t bytes = 0;
  for (const auto& slot : adopted_) {
    const auto impl = slot.storage.lock();
    if (impl && impl->data_ptr().get() == slot.at) bytes += slot.bytes;
  }
  return bytes;
}

Stream OdcBackend::keyedStream(Engine& eng, const at::Tensor& a, const at::Tensor& b,
                               const char* op, int key) {
  const int device = eng.transport().deviceIndex();
  const bool on_cuda = device >= 0;
  const auto where = [&] {
    return c10::str("odc: rank ", rank_, ": keyed ", op, " of key '",
                    eng.layout().key(static_cast<size_t>(key)).name, "' on ", a.device(), " and ",
                    b.device(), ", but the model was attached on ",
                    on_cuda ? "cuda:" + std::to_string(device) : std::string("cpu"));
  };
  TORCH_CHECK(a.device() == b.device(), where());
  if (!on_cuda) {
    TORCH_CHECK(a.device().is_cpu(), where());
    return nullptr;
  }
  TORCH_CHECK(a.device().is_cuda() && a.device().index() == device, where());
#ifdef ODC_WITH_CUDA
  return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
#else
  return nullptr;
#endif
}

WorkPtr OdcBackend::keyedWork(c10d::OpType type, const at::Tensor& output,
                              const at::Tensor& input) {
#ifdef ODC_WITH_CUDA
  if (output.is_cuda()) {
    engine("keyed work");  // raises if none is connected
    return c10::make_intrusive<CudaEventWork>(
        rank_, type, std::vector<at::Tensor>{output, input},
        at::cuda::getCurrentCUDAStream(output.device().index()).stream(),
        c10::intrusive_ptr<OdcBackend>::reclaim_copy(this), engine_generation_ - 1);
  }
#endif
  (void)input;
  return c10::make_intrusive<CompletedWork>(rank_, type, std::vector<at::Tensor>{output});
}

void OdcBackend::checkDeviceErrors(int generation) {
#ifdef ODC_WITH_CUDA
  std::shared_ptr<Engine> eng;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!engine_ || generation != engine_generation_ - 1) return;  // detached since
    eng = engine_;
  }
  if (auto* t = dynamic_cast<CudaIpcTransport*>(&eng->transport())) t->checkDeviceErrors();
#else
  (void)generation;
#endif
}

void OdcBackend::shutdown() { close(/*abort=*/false); }

void OdcBackend::abort() { close(/*abort=*/true); }

void OdcBackend::close(bool abort) {
  BackendPtr cuda;
  BackendPtr cpu;
  BackendFactory factory;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) {
      return;
    }
    shutdown_ = true;
    cuda = std::move(cuda_);
    cpu = std::move(cpu_);
    factory = std::move(cuda_factory_);
    // Abort: every pending device wait returns at once, so closing the engine never waits
    // for a peer. Shutdown waits for pending ODC work under the op deadlines.
    if (abort && engine_) engine_->transport().abort();
    engine_.reset();  // unmaps the shared regions once no call holds it any more
  }
  factory = nullptr;  // may release a Python callable: never under mu_
  for (auto* inner : {&cuda, &cpu}) {
    if (*inner) {
      abort ? (*inner)->abort() : (*inner)->shutdown();
    }
  }
  // Dropping the inner backends here (torch calls this without the GIL) joins gloo's worker
  // threads now. Left to process exit, a worker could still be releasing the tensors of a
  // finished op while the interpreter finalizes, and die taking the GIL (std::terminate).
  cpu.reset();
  cuda.reset();
}

}  // namespace torch_odc
