#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "transport/cuda_ipc/kernels.h"

namespace torch_odc::cuda_ipc {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw OdcError(std::string("odc: CUDA error in ") + what + ": " + cudaGetErrorString(err));
  }
}

__device__ __forceinline__ uint64_t globalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint64_t loadAcquireSys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void storeReleaseSys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__global__ void publishKernel(uint64_t* flag, uint64_t value) {
  // Earlier work on this stream (the shard-cache copy) has completed; make it visible to every
  // device before the flag, which peers read with an acquire load.
  __threadfence_system();
  storeReleaseSys(flag, value);
}

__global__ void publishFlagsKernel(uint8_t* first, size_t count, size_t stride, uint64_t value) {
  // As publishKernel, one flag per thread (the shard-cache fills before it on the stream have
  // completed): each thread's fence orders them before its own release store.
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) {
    __threadfence_system();
    storeReleaseSys(reinterpret_cast<uint64_t*>(first + i * stride), value);
  }
}

// The 16-byte vector paths need both buffers 16-byte aligned (FSDP2 chunks need not be).
__device__ __forceinline__ bool aligned16(const void* a, const void* b) {
  return (reinterpret_cast<uintptr_t>(a) % 16 == 0) && (reinterpret_cast<uintptr_t>(b) % 16 == 0);
}

// ---- one launch per keyed operation, all peers (blockIdx.y = entry) ----

// True once any wait of this rank failed or the host aborted (mapped host memory, read through).
// Only the one waiting thread of the one-block wait kernel reads these host words: a read of
// mapped host memory from every block of a multi-block kernel serializes over PCIe (measured
// 0.3-0.6 ms per launch on an H100).
__device__ __forceinline__ bool hostStopped(const DeviceError* error) {
  return *reinterpret_cast<const volatile uint32_t*>(&error->flag) != 0 ||
         *reinterpret_cast<const volatile uint32_t*>(&error->abort) != 0;
}

// The stop word in this rank's device memory (L2-resident for the copy and push kernels).
__device__ __forceinline__ bool deviceStopped(const uint32_t* stop) {
  return *reinterpret_cast<const volatile uint32_t*>(stop) != 0;
}

__device__ __forceinline__ void setStop(uint32_t* stop) {
  *reinterpret_cast<volatile uint32_t*>(stop) = 1u;
  __threadfence();
}

// Every block of a copy or push kernel: skip the whole block once a wait before it failed or the
// host aborted (the peer's region may be gone). One device-memory load per block.
__device__ __forceinline__ bool blockSkips(const uint32_t* stop) {
  __shared__ bool skip;
  if (threadIdx.x == 0) skip = deviceStopped(stop);
  __syncthreads();
  return skip;
}

// One thread per entry acquire-spins on the entry's flag (a one-block kernel: a wait for a slow
// peer, e.g. for a prefetched layer it has not reached, holds no SM resources that compute on
// this GPU needs). The copy kernel after it on the stream reads only after every wait.
__global__ void odcWaitAllKernel(GatherArgs a, uint64_t value, uint64_t deadline_ns,
                                 DeviceError* error, uint32_t* stop) {
  const int y = threadIdx.x;
  if (y >= a.count) return;
  if (deviceStopped(stop)) return;
  uint32_t backoff = 32;
  while (loadAcquireSys(a.flag[y]) < value) {
    // Another wait gave up or the host aborted (dead peer, close): stop every copy and push
    // behind this wait (the device stop word, read by the multi-block kernels) and return; the
    // host raises.
    if (hostStopped(error)) {
      setStop(stop);
      return;
    }
    if (globalTimerNs() > deadline_ns) {
      // Give up: the host sees this at the next keyed call, Work::wait or the barrier, and
      // raises; the data behind this wait is never copied or used.
      if (atomicCAS(&error->flag, 0u, 2u) == 0u) {  // the first failure names its wait
        error->slot = a.slot[y];
        __threadfence_system();
        atomicExch(&error->flag, 1u);
      }
      setStop(stop);
      return;
    }
    __nanosleep(backoff);
    if (backoff < 1024) backoff *= 2;
  }
}

// The gather kernels' main loop: `vecs` vectors of `s`, each stored into `d` as `convert` makes
// it, in a grid-stride loop with 8 loads in flight per thread before their stores.
template <typename In, typename Out, typename Convert>
__device__ __forceinline__ void copyVectors(const In* s, Out* d, size_t vecs, size_t tid,
                                            size_t stride, Convert convert) {
  constexpr int kUnroll = 8;
  for (size_t base = tid; base < vecs; base += stride * kUnroll) {
    In v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < vecs) v[u] = s[base + u * stride];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * stride < vecs) d[base + u * stride] = convert(v[u]);
    }
  }
}

__global__ void __launch_bounds__(512)
    odcGatherKernel(GatherArgs a, size_t bytes, const uint32_t* stop) {
  if (blockSkips(stop)) return;
  const int y = blockIdx.y;
  const uint8_t* src = a.src[y];
  uint8_t* dst = a.dst[y];
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (aligned16(src, dst)) {
    // Plain (coherent) loads: the peer rewrites its cache every minibatch.
    const size_t vecs = bytes / 16;
    copyVectors(reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst), vecs, tid,
                stride, [](uint4 v) { return v; });
    done = vecs * 16;
  }
  for (size_t i = done + tid; i < bytes; i += stride) dst[i] = src[i];
}

// The gather of an fp32 shard cache into a 16-bit output (the sharded fp32 parameters rounded to
// the mixed-precision dtype as they are read, round to nearest even, as torch's cast): 16-byte
// loads of 4 floats (8 in flight per thread), 8-byte stores.
__device__ __forceinline__ uint32_t narrowBits(float v, __nv_bfloat16*) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ uint32_t narrowBits(float v, __half*) {
  return __half_as_ushort(__float2half_rn(v));
}

template <typename T>
__global__ void __launch_bounds__(512)
    odcGatherNarrowKernel(GatherArgs a, size_t numel, const uint32_t* stop) {
  if (blockSkips(stop)) return;
  const int y = blockIdx.y;
  const float* src = reinterpret_cast<const float*>(a.src[y]);
  auto* dst = reinterpret_cast<uint16_t*>(a.dst[y]);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 8 == 0) {
    const size_t vecs = numel / 4;
    copyVectors(reinterpret_cast<const float4*>(src), reinterpret_cast<uint2*>(dst), vecs, tid,
                stride, [](float4 v) {
                  uint2 o;
                  o.x = narrowBits(v.x, static_cast<T*>(nullptr)) |
                        (narrowBits(v.y, static_cast<T*>(nullptr)) << 16);
                  o.y = narrowBits(v.z, static_cast<T*>(nullptr)) |
                        (narrowBits(v.w, static_cast<T*>(nullptr)) << 16);
                  return o;
                });
    done = vecs * 4;
  }
  for (size_t i = done + tid; i < numel; i += stride) {
    dst[i] = static_cast<uint16_t>(narrowBits(src[i], static_cast<T*>(nullptr)));
  }
}

__global__ void readClockKernel(DeviceError* error) { error->clock = globalTimerNs(); }

__device__ __forceinline__ void red4(float* dst, float4 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), v);
#else
  atomicAdd(dst, v.x);
  atomicAdd(dst + 1, v.y);
  atomicAdd(dst + 2, v.z);
  atomicAdd(dst + 3, v.w);
#endif
}

template <typename T>
__device__ __forceinline__ float toFloat(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(v);
  } else {
    return __half2float(v);
  }
}

// Eight 16-bit values (one uint4) widened to fp32, scaled, and added into eight fp32 accumulator
// elements with two 16-byte vector reductions.
template <typename T>
__device__ __forceinline__ void red8(float* dst, uint4 raw, float scale) {
  const T* h = reinterpret_cast<const T*>(&raw);
  red4(dst, make_float4(toFloat(h[0]) * scale, toFloat(h[1]) * scale, toFloat(h[2]) * scale,
                        toFloat(h[3]) * scale));
  red4(dst + 4, make_float4(toFloat(h[4]) * scale, toFloat(h[5]) * scale, toFloat(h[6]) * scale,
                            toFloat(h[7]) * scale));
}

// The fp32 accumulator dst[y][i] += scale * src[y][i], src in T (fp32, bf16 or fp16).
template <typename T>
__global__ void __launch_bounds__(512)
    odcPushKernel(PushArgs a, size_t numel, float scale, const uint32_t* stop) {
  if (blockSkips(stop)) return;
  const int y = blockIdx.y;
  float* dst = static_cast<float*>(a.dst[y]);
  const T* src = static_cast<const T*>(a.src[y]);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  constexpr size_t kPerVec = 16 / sizeof(T);  // source elements per 16-byte load
  size_t done = 0;
  if (aligned16(dst, src)) {
    const size_t vecs = numel / kPerVec;
    const uint4* s4 = reinterpret_cast<const uint4*>(src);
    constexpr int kUnroll = 4;  // independent loads in flight before the reductions
    for (size_t base = tid; base < vecs; base += stride * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (base + u * stride < vecs) v[u] = __ldg(s4 + base + u * stride);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const size_t i = base + u * stride;
        if (i >= vecs) break;
        if constexpr (std::is_same_v<T, float>) {
          float4 x = *reinterpret_cast<float4*>(&v[u]);
          x.x *= scale;
          x.y *= scale;
          x.z *= scale;
          x.w *= scale;
          red4(dst + i * kPerVec, x);
        } else {
          red8<T>(dst + i * kPerVec, v[u], scale);
        }
      }
    }
    done = vecs * kPerVec;
  }
  for (size_t i = done + tid; i < numel; i += stride) atomicAdd(dst + i, toFloat(src[i]) * scale);
}

// ---- the bulk push (sm_90): whole tiles reduced into the accumulator by the TMA unit ----
//
// Each block widens and scales a tile of the source into shared memory, and one thread hands the
// tile to cp.reduce.async.bulk (.add.f32): the tensor memory accelerator adds it into the owner's
// accumulator, element-wise atomically (as the red.v4 of the element path), at L2 line
// granularity rather than one 16-byte reduction per thread. Two shared-memory stages: the next
// tile is widened while the previous one's bulk reduction reads its stage. The part of an entry
// after its last whole tile goes through the element path.
constexpr int kBulkThreads = 512;
constexpr int kBulkTile = 4096;  // fp32 elements per stage (16 KiB)

__device__ __forceinline__ void bulkReduceAddF32(float* dst, const float* smem, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst),
      "r"(s), "r"(bytes)
      : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
#else
  __trap();  // never launched below sm_90 (the transport picks the element path there)
#endif
}

// The bulk reduction issued two tiles ago has finished reading its stage (at most one pending).
__device__ __forceinline__ void bulkWaitRead1() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
#endif
}

// Every bulk reduction of this thread has completed (its writes performed).
__device__ __forceinline__ void bulkWaitAll() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// Shared-memory writes of the generic proxy made visible to the async proxy (the bulk copy).
__device__ __forceinline__ void fenceProxyAsyncShared() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

template <typename T>
__global__ void __launch_bounds__(kBulkThreads)
    odcPushBulkKernel(PushArgs a, size_t numel, float scale, const uint32_t* stop) {
  if (blockSkips(stop)) return;
  __shared__ __align__(128) float stage[2][kBulkTile];
  const int y = blockIdx.y;
  float* dst = static_cast<float*>(a.dst[y]);
  const T* src = static_cast<const T*>(a.src[y]);
  const size_t tiles = numel / kBulkTile;
  constexpr int kPerVec = 16 / sizeof(T);                    // source elements per uint4
  constexpr int kVecs = kBulkTile / kPerVec / kBulkThreads;  // uint4 loads per thread per tile
  int it = 0;
  for (size_t t = blockIdx.x; t < tiles; t += gridDim.x, ++it) {
    float* st = stage[it & 1];
    if (it >= 2) {
      if (threadIdx.x == 0) bulkWaitRead1();
      __syncthreads();
    }
    const uint4* s4 = reinterpret_cast<const uint4*>(src + t * kBulkTile);
    uint4 v[kVecs];
#pragma unroll
    for (int u = 0; u < kVecs; ++u) v[u] = __ldg(s4 + threadIdx.x + u * kBulkThreads);
#pragma unroll
    for (int u = 0; u < kVecs; ++u) {
      const int e = (threadIdx.x + u * kBulkThreads) * kPerVec;  // first element of this load
      const T* h = reinterpret_cast<const T*>(&v[u]);
#pragma unroll
      for (int q = 0; q < kPerVec; q += 4) {
        *reinterpret_cast<float4*>(st + e + q) =
            make_float4(toFloat(h[q]) * scale, toFloat(h[q + 1]) * scale, toFloat(h[q + 2]) * scale,
                        toFloat(h[q + 3]) * scale);
      }
    }
    fenceProxyAsyncShared();
    __syncthreads();
    if (threadIdx.x == 0) {
      bulkReduceAddF32(dst + t * kBulkTile, st, kBulkTile * sizeof(float));
    }
  }
  if (threadIdx.x == 0) bulkWaitAll();
  // The part after the last whole tile: the element path, spread over the entry's blocks.
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t tid = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (size_t i = tiles * kBulkTile + tid; i < numel; i += stride) {
    atomicAdd(dst + i, toFloat(src[i]) * scale);
  }
}

// The bulk push needs a 16-byte aligned source and accumulator and one whole tile (and sm_90: the
// transport asks for it only there).
bool bulkPushFits(const PushArgs& args, size_t numel) {
  if (numel < static_cast<size_t>(kBulkTile)) return false;
  for (int i = 0; i < args.count; ++i) {
    if (reinterpret_cast<uintptr_t>(args.dst[i]) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(args.src[i]) % 16 != 0) {
      return false;
    }
  }
  return true;
}

int blocksPerEntry(int ctas, int entries, size_t work_vecs, int threads) {
  const size_t needed = (work_vecs + threads - 1) / threads;
  const int per = std::max(1, ctas / std::max(1, entries));
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(per, needed)));
}

}  // namespace

void launchPublish(uint64_t* flag, uint64_t value, cudaStream_t stream) {
  publishKernel<<<1, 1, 0, stream>>>(flag, value);
  check(cudaGetLastError(), "publish kernel launch");
}

void launchPublishFlags(uint8_t* first, size_t count, size_t stride, uint64_t value,
                        cudaStream_t stream) {
  if (count == 0) return;
  const unsigned threads = static_cast<unsigned>(std::min<size_t>(count, 256));
  publishFlagsKernel<<<1, threads, 0, stream>>>(first, count, stride, value);
  check(cudaGetLastError(), "publish kernel launch");
}

void launchReadClock(DeviceError* error, cudaStream_t stream) {
  readClockKernel<<<1, 1, 0, stream>>>(error);
  check(cudaGetLastError(), "clock kernel launch");
}

cudaError_t kernelImageProblem(int device) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(device);
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, odcWaitAllKernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, odcGatherKernel);
  cudaGetLastError();  // not sticky: clear it
  cudaSetDevice(prev);
  return err;
}

// The per-peer path (ODC_CUDA_FUSED=0) runs the same kernels with one entry.
void launchWait(const uint64_t* peer_flag, uint64_t value, uint64_t deadline_ns, DeviceError* error,
                uint32_t* stop, uint32_t slot, cudaStream_t stream) {
  GatherArgs args;
  args.flag[0] = peer_flag;
  args.slot[0] = slot;
  args.count = 1;
  odcWaitAllKernel<<<1, 32, 0, stream>>>(args, value, deadline_ns, error, stop);
  check(cudaGetLastError(), "wait kernel launch");
}

void launchRead(void* dst, const void* src, size_t bytes, const uint32_t* stop, int ctas,
                cudaStream_t stream) {
  GatherArgs args;
  args.src[0] = static_cast<const uint8_t*>(src);
  args.dst[0] = static_cast<uint8_t*>(dst);
  args.count = 1;
  constexpr int kThreads = 512;
  const dim3 grid(blocksPerEntry(ctas, 1, bytes / 16, kThreads), 1);
  odcGatherKernel<<<grid, kThreads, 0, stream>>>(args, bytes, stop);
  check(cudaGetLastError(), "read kernel launch");
}

namespace {

// The copy kernel of one gather (every entry), by the cache and output dtypes.
void launchCopies(const GatherArgs& args, size_t numel, DType from, DType to, int ctas,
                  const uint32_t* stop, cudaStream_t stream) {
  constexpr int kThreads = 512;
  const size_t src_bytes = numel * elementSize(from);
  const dim3 grid(blocksPerEntry(ctas, args.count, src_bytes / 16, kThreads), args.count);
  if (from == to) {
    odcGatherKernel<<<grid, kThreads, 0, stream>>>(args, src_bytes, stop);
  } else if (from == DType::kFloat32 && to == DType::kBFloat16) {
    odcGatherNarrowKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(args, numel, stop);
  } else if (from == DType::kFloat32 && to == DType::kFloat16) {
    odcGatherNarrowKernel<__half><<<grid, kThreads, 0, stream>>>(args, numel, stop);
  } else {
    throw OdcError(std::string("odc: cannot read a ") + dtypeName(from) + " shard cache as " +
                   dtypeName(to));
  }
  check(cudaGetLastError(), "gather kernel launch");
}

}  // namespace

void launchReadAs(void* dst, const void* src, size_t numel, DType from, DType to,
                  const uint32_t* stop, int ctas, cudaStream_t stream) {
  GatherArgs args;
  args.src[0] = static_cast<const uint8_t*>(src);
  args.dst[0] = static_cast<uint8_t*>(dst);
  args.count = 1;
  launchCopies(args, numel, from, to, ctas, stop, stream);
}

void launchPush(void* dst, const void* src, size_t numel, DType dtype, float scale,
                const uint32_t* stop, int sm_count, cudaStream_t stream) {
  PushArgs args;
  args.dst[0] = dst;
  args.src[0] = src;
  args.count = 1;
  launchPushAll(args, numel, dtype, scale, stop, 2 * sm_count, PushMode::kElement, stream);
}

void launchGather(const GatherArgs& args, size_t numel, DType from, DType to, uint64_t value,
                  uint64_t deadline_ns, DeviceError* error, uint32_t* stop, int ctas, bool wait,
                  cudaStream_t stream) {
  if (args.count == 0) return;
  if (wait) {
    odcWaitAllKernel<<<1, 32, 0, stream>>>(args, value, deadline_ns, error, stop);
    check(cudaGetLastError(), "wait kernel launch");
  }
  if (numel == 0) return;  // a wait only (the owners' release before a minibatch's first push)
  launchCopies(args, numel, from, to, ctas, stop, stream);
}

void launchPushAll(const PushArgs& args, size_t numel, DType dtype, float scale,
                   const uint32_t* stop, int ctas, PushMode mode, cudaStream_t stream) {
  if (args.count == 0) return;
  if (mode == PushMode::kBulk && bulkPushFits(args, numel)) {
    const size_t tiles = numel / kBulkTile;
    const dim3 grid(static_cast<unsigned>(std::max<size_t>(
                        1, std::min<size_t>(tiles, std::max(1, ctas / args.count)))),
                    args.count);
    switch (dtype) {
      case DType::kFloat32:
        odcPushBulkKernel<float><<<grid, kBulkThreads, 0, stream>>>(args, numel, scale, stop);
        break;
      case DType::kBFloat16:
        odcPushBulkKernel<__nv_bfloat16>
            <<<grid, kBulkThreads, 0, stream>>>(args, numel, scale, stop);
        break;
      case DType::kFloat16:
        odcPushBulkKernel<__half><<<grid, kBulkThreads, 0, stream>>>(args, numel, scale, stop);
        break;
      default:
        throw OdcError(std::string("odc: CUDA pushes of ") + dtypeName(dtype) +
                       " are not supported (fp32, bf16, fp16)");
    }
    check(cudaGetLastError(), "bulk push kernel launch");
    return;
  }
  constexpr int kThreads = 512;
  const size_t elem = dtype == DType::kFloat32 ? 4 : 2;
  const dim3 grid(blocksPerEntry(ctas, args.count, numel * elem / 16, kThreads), args.count);
  switch (dtype) {
    case DType::kFloat32:
      odcPushKernel<float><<<grid, kThreads, 0, stream>>>(args, numel, scale, stop);
      break;
    case DType::kBFloat16:
      odcPushKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(args, numel, scale, stop);
      break;
    case DType::kFloat16:
      odcPushKernel<__half><<<grid, kThreads, 0, stream>>>(args, numel, scale, stop);
      break;
    default:
      throw OdcError(std::string("odc: CUDA pushes of ") + dtypeName(dtype) +
                     " are not supported (fp32, bf16, fp16)");
  }
  check(cudaGetLastError(), "push kernel launch");
}

}  // namespace torch_odc::cuda_ipc
