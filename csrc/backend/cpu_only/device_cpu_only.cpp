// backend/device.h in CPU-only builds (setup.py compiles this file only then): the engine's
// transport is the shared-memory one, so nothing here is reached with a GPU tensor; what could
// be refuses naming what the build lacks.
#include <c10/util/Exception.h>

#include "backend/device.h"

namespace torch_odc::device {

bool hasCudaTransport() { return false; }

std::unique_ptr<Transport> makeCudaTransport(int rank, int /*world*/, int /*device_index*/) {
  TORCH_CHECK(false, "odc: rank ", rank,
              ": this build of torch_odc has no CUDA transport "
              "(built without a CUDA toolkit matching torch); rebuild on a CUDA machine");
}

std::function<void()> allocationRetry() { return nullptr; }

std::string cudaTransportProblem(int /*rank*/, int /*world*/, int /*device_index*/,
                                 Rendezvous& /*rdv*/, const std::string& /*prefix*/,
                                 std::chrono::milliseconds /*timeout*/) {
  return "this build of torch_odc has no CUDA transport";
}

Stream currentStream(int /*device*/) { return nullptr; }

void zeroAsync(void* /*p*/, size_t /*bytes*/, Stream /*stream*/) {
  TORCH_CHECK(false, "odc: a device tensor in a build without CUDA");
}

void copyAsync(void* /*dst*/, const void* /*src*/, size_t /*bytes*/, Stream /*stream*/) {
  TORCH_CHECK(false, "odc: a device parameter in a build without CUDA");
}

void recordStream(const c10::DataPtr& /*old*/, int /*device*/) {}

c10::intrusive_ptr<c10d::Work> eventWork(int rank, c10d::OpType /*type*/,
                                         const at::Tensor& /*output*/, const at::Tensor& /*input*/,
                                         c10::intrusive_ptr<OdcBackend> /*backend*/,
                                         int /*generation*/) {
  TORCH_CHECK(false, "odc: rank ", rank, ": a keyed CUDA Work in a build without CUDA");
}

void rangePush(const char* /*name*/) {}

void rangePop() {}

}  // namespace torch_odc::device
