// What the backend glue does only with CUDA, behind one small interface: defined by
// backend/cuda/device_cuda.cpp in builds with CUDA and by backend/cpu_only/device_cpu_only.cpp in
// CPU-only builds (setup.py compiles exactly one of the two). In a CPU-only build the engine's
// transport is always the shared-memory one, so the calls that need a GPU are never reached with
// one; those that could be raise naming what is missing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "engine/engine.h"
#include "engine/rendezvous.h"
#include "engine/transport.h"

namespace torch_odc {

class OdcBackend;

namespace device {

// Whether this build holds the CUDA IPC transport.
bool hasCudaTransport();
// The CUDA IPC transport of `rank` on GPU `device_index`; raises in a CPU-only build.
std::unique_ptr<Transport> makeCudaTransport(int rank, int world, int device_index);
// What a failed accumulator allocation on the GPU runs before its one retry (returns torch's
// cached CUDA blocks); null in a CPU-only build.
std::function<void()> allocationRetry();
// Collective over the group: "" when the CUDA IPC transport can run on `device_index` with every
// rank's GPU, otherwise why not (CudaIpcTransport::supportProblem), or that this build has none.
std::string cudaTransportProblem(int rank, int world, int device_index, Rendezvous& rdv,
                                 const std::string& prefix, std::chrono::milliseconds timeout);

// The caller's current CUDA stream of GPU `device` as the engine's Stream; null for device < 0.
Stream currentStream(int device);
// Zeroes `bytes` of GPU memory at `p`, ordered on `stream`.
void zeroAsync(void* p, size_t bytes, Stream stream);
// Copies `bytes` of GPU memory from `src` to `dst`, ordered on `stream`.
void copyAsync(void* dst, const void* src, size_t bytes, Stream stream);
// `old`, a block of torch's CUDA caching allocator, is read by work on GPU `device`'s current
// stream: the allocator reuses it only after that work.
void recordStream(const c10::DataPtr& old, int device);

// The Work of a keyed op enqueued on the current stream of `output`'s GPU: complete when that
// work is; wait() makes the caller's current stream wait for it and raises a device-side error
// of the engine connected as `generation` (OdcBackend::checkDeviceErrors). Holds the tensors
// and the backend until destroyed.
c10::intrusive_ptr<c10d::Work> eventWork(int rank, c10d::OpType type, const at::Tensor& output,
                                         const at::Tensor& input,
                                         c10::intrusive_ptr<OdcBackend> backend, int generation);

// A range in NVTX (Nsight Systems) around one ODC operation; nothing in a CPU-only build.
void rangePush(const char* name);
void rangePop();

}  // namespace device
}  // namespace torch_odc
