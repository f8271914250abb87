#include "backend/odc_backend.h"

#include <c10/util/Exception.h>

#include <torch/csrc/distributed/c10d/Types.hpp>

namespace torch_odc {

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
