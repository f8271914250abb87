// backend/device.h in builds with CUDA (setup.py compiles this file only then).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <nvtx3/nvToolsExt.h>

#include "backend/device.h"
#include "backend/odc_backend.h"
#include "transport/cuda_ipc/cuda_ipc_transport.h"

namespace torch_odc::device {

namespace {

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

}  // namespace

bool hasCudaTransport() { return true; }

std::unique_ptr<Transport> makeCudaTransport(int rank, int world, int device_index) {
  return std::make_unique<CudaIpcTransport>(rank, world, device_index);
}

std::function<void()> allocationRetry() {
  return [] { c10::cuda::CUDACachingAllocator::emptyCache(); };
}

std::string cudaTransportProblem(int rank, int world, int device_index, Rendezvous& rdv,
                                 const std::string& prefix, std::chrono::milliseconds timeout) {
  return CudaIpcTransport::supportProblem(rank, world, device_index, rdv, prefix, timeout);
}

Stream currentStream(int device) {
  if (device < 0) return nullptr;
  return at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
}

void zeroAsync(void* p, size_t bytes, Stream stream) {
  C10_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, static_cast<cudaStream_t>(stream)));
}

void copyAsync(void* dst, const void* src, size_t bytes, Stream stream) {
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                                 static_cast<cudaStream_t>(stream)));
}

void recordStream(const c10::DataPtr& old, int device) {
  c10::cuda::CUDACachingAllocator::recordStream(
      old, at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
}

c10::intrusive_ptr<c10d::Work> eventWork(int rank, c10d::OpType type, const at::Tensor& output,
                                         const at::Tensor& input,
                                         c10::intrusive_ptr<OdcBackend> backend, int generation) {
  return c10::make_intrusive<CudaEventWork>(
      rank, type, std::vector<at::Tensor>{output, input},
      at::cuda::getCurrentCUDAStream(output.device().index()).stream(), std::move(backend),
      generation);
}

void rangePush(const char* name) { nvtxRangePushA(name); }

void rangePop() { nvtxRangePop(); }

}  // namespace torch_odc::device
