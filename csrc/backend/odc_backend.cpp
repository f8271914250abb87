#include "backend/odc_backend.h"

#include <c10/util/Exception.h>

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
  if (device == c10::DeviceType::CPU) {
    return cpu_;
  }
  TORCH_CHECK(device == c10::DeviceType::CUDA, "odc: rank ", rank_,
              ": tensors on device type ", c10::DeviceTypeName(device),
              " are not supported (only cpu and cuda)");
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!shutdown_, "odc: rank ", rank_, ": CUDA collective after shutdown");
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

c10::DeviceType OdcBackend::deviceOf(const std::vector<at::Tensor>& tensors,
                                     const char* op) const {
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
  return forward(deviceOf(tensors, "broadcast"), [&](c10d::Backend& b) { return b.broadcast(tensors, opts); });
}

WorkPtr OdcBackend::allreduce(std::vector<at::Tensor>& tensors,
                              const c10d::AllreduceOptions& opts) {
  return forward(deviceOf(tensors, "allreduce"), [&](c10d::Backend& b) { return b.allreduce(tensors, opts); });
}

WorkPtr OdcBackend::allreduce_sparse(std::vector<at::Tensor>& tensors,
                                     const c10d::AllreduceOptions& opts) {
  return forward(deviceOf(tensors, "allreduce_sparse"), [&](c10d::Backend& b) { return b.allreduce_sparse(tensors, opts); });
}

WorkPtr OdcBackend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                        const c10d::AllreduceCoalescedOptions& opts) {
  return forward(deviceOf(tensors, "allreduce_coalesced"), [&](c10d::Backend& b) { return b.allreduce_coalesced(tensors, opts); });
}

WorkPtr OdcBackend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  return forward(deviceOf(tensors, "reduce"), [&](c10d::Backend& b) { return b.reduce(tensors, opts); });
}

WorkPtr OdcBackend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                              std::vector<at::Tensor>& inputs,
                              const c10d::AllgatherOptions& opts) {
  return forward(deviceOf(inputs, "allgather"), [&](c10d::Backend& b) { return b.allgather(outputs, inputs, opts); });
}

WorkPtr OdcBackend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                    const c10d::AllgatherOptions& opts) {
  return forward(input.device().type(), [&](c10d::Backend& b) { return b._allgather_base(output, input, opts); });
}

WorkPtr OdcBackend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::AllgatherOptions& opts) {
  return forward(deviceOf(inputs, "allgather_coalesced"), [&](c10d::Backend& b) { return b.allgather_coalesced(outputs, inputs, opts); });
}

WorkPtr OdcBackend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::AllgatherOptions& opts) {
  return forward(deviceOf(inputs, "allgather_into_tensor_coalesced"), [&](c10d::Backend& b) { return b.allgather_into_tensor_coalesced(outputs, inputs, opts); });
}

WorkPtr OdcBackend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                           std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  return forward(deviceOf(inputs, "gather"), [&](c10d::Backend& b) { return b.gather(outputs, inputs, opts); });
}

WorkPtr OdcBackend::scatter(std::vector<at::Tensor>& outputs,
                            std::vector<std::vector<at::Tensor>>& inputs,
                            const c10d::ScatterOptions& opts) {
  return forward(deviceOf(outputs, "scatter"), [&](c10d::Backend& b) { return b.scatter(outputs, inputs, opts); });
}

WorkPtr OdcBackend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                   std::vector<std::vector<at::Tensor>>& inputs,
                                   const c10d::ReduceScatterOptions& opts) {
  return forward(deviceOf(outputs, "reduce_scatter"), [&](c10d::Backend& b) { return b.reduce_scatter(outputs, inputs, opts); });
}

WorkPtr OdcBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                         const c10d::ReduceScatterOptions& opts) {
  return forward(input.device().type(), [&](c10d::Backend& b) { return b._reduce_scatter_base(output, input, opts); });
}

WorkPtr OdcBackend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                    std::vector<at::Tensor>& inputs,
                                                    const c10d::ReduceScatterOptions& opts) {
  return forward(deviceOf(inputs, "reduce_scatter_tensor_coalesced"), [&](c10d::Backend& b) { return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts); });
}

WorkPtr OdcBackend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                  std::vector<int64_t>& output_split_sizes,
                                  std::vector<int64_t>& input_split_sizes,
                                  const c10d::AllToAllOptions& opts) {
  return forward(input.device().type(), [&](c10d::Backend& b) { return b.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts); });
}

WorkPtr OdcBackend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                             const c10d::AllToAllOptions& opts) {
  return forward(deviceOf(inputs, "alltoall"), [&](c10d::Backend& b) { return b.alltoall(outputs, inputs, opts); });
}

WorkPtr OdcBackend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  return forward(deviceOf(tensors, "send"), [&](c10d::Backend& b) { return b.send(tensors, dst_rank, tag); });
}

WorkPtr OdcBackend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  return forward(deviceOf(tensors, "recv"), [&](c10d::Backend& b) { return b.recv(tensors, src_rank, tag); });
}

WorkPtr OdcBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return forward(deviceOf(tensors, "recvAnysource"), [&](c10d::Backend& b) { return b.recvAnysource(tensors, tag); });
}

WorkPtr OdcBackend::barrier(const c10d::BarrierOptions& opts) {
  // A barrier on an explicit CUDA device (dist.barrier(device_ids=...)) goes through NCCL so it
  // also orders the device streams, as with backend="nccl"; every other barrier uses Gloo.
  const bool on_cuda = (opts.device.has_value() && opts.device->is_cuda()) ||
                       !opts.device_ids.empty();
  return forward(on_cuda ? c10::DeviceType::CUDA : c10::DeviceType::CPU, [&](c10d::Backend& b) { return b.barrier(opts); });
}

void OdcBackend::monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) {
  checkAlive("monitored_barrier");
  cpu_->monitoredBarrier(opts, wait_all_ranks);
}

void OdcBackend::setSequenceNumberForGroup() { cpu_->setSequenceNumberForGroup(); }

uint64_t OdcBackend::getSequenceNumberForGroup() { return cpu_->getSequenceNumberForGroup(); }

void OdcBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  cpu_->setTimeout(timeout);
  if (auto cuda = cudaBackendIfCreated()) {
    cuda->setTimeout(timeout);
  }
}

void OdcBackend::setGroupUid(const std::string& pg_uid) {
  c10d::Backend::setGroupUid(pg_uid);
  cpu_->setGroupUid(pg_uid + ":odc-gloo");
  if (auto cuda = cudaBackendIfCreated()) {
    cuda->setGroupUid(pg_uid + ":odc-nccl");
  }
}

void OdcBackend::shutdown() {
  BackendPtr cuda;
  BackendFactory factory;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) {
      return;
    }
    shutdown_ = true;
    cuda = std::move(cuda_);
    factory = std::move(cuda_factory_);
  }
  factory = nullptr;  // may release a Python callable: never under mu_
  if (cuda) {
    cuda->shutdown();
  }
  cpu_->shutdown();
}

void OdcBackend::abort() {
  BackendPtr cuda;
  BackendFactory factory;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shutdown_) {
      return;
    }
    shutdown_ = true;
    cuda = std::move(cuda_);
    factory = std::move(cuda_factory_);
  }
  factory = nullptr;  // may release a Python callable: never under mu_
  if (cuda) {
    cuda->abort();
  }
  cpu_->abort();
}

}  // namespace torch_odc
