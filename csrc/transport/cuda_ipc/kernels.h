// Device-side pieces of the CUDA IPC transport: publish (release store of an epoch flag), wait
// (acquire spin on a peer's flag with a deadline), push-accumulate (remote reductions over
// NVLink). Launch wrappers are host functions; everything runs on the given stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "engine/types.h"

namespace torch_odc::cuda_ipc {

// Written by a wait kernel that gives up; read by the host (mapped pinned memory).
struct DeviceError {
  uint32_t flag;  // 0 = no error
  uint32_t slot;  // which wait (index into the host's description ring)
};

void launchPublish(uint64_t* flag, uint64_t value, cudaStream_t stream);
void launchWait(const uint64_t* peer_flag, uint64_t value, uint64_t timeout_ns,
                DeviceError* error, uint32_t slot, cudaStream_t stream);
// dst[i] += scale * src[i] for i < numel, with remote reductions; then *pushed_flag = epoch.
void launchPush(void* dst, const void* src, size_t numel, DType dtype, float scale,
                uint64_t* pushed_flag, uint64_t epoch, int sm_count, cudaStream_t stream);

}  // namespace torch_odc::cuda_ipc
