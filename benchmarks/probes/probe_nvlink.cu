// probe_nvlink.cu -- standalone single-process multi-GPU probe (no torch, no MPI) comparing
// candidate designs for two one-sided NVLink primitives between GPUs of one host:
//   gather ("G_*"): GPU g pulls every peer's shard S into out[p*S..]   (all-gather shape)
//   push   ("P_*"): GPU g adds its fp32 chunk p into GPU p's acc       (reduce-scatter shape)
// Build:  nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/probe_nvlink benchmarks/probes/probe_nvlink.cu
// Run:    /tmp/probe_nvlink [--gpus N] [--sizes 16M,64M,256M,1G] [--json probe_nvlink.json]
//                           [--only G_sm,P_red] [--iters 20] [--warmup 3]
// Timing: all N GPUs run concurrently. Per iteration every GPU's stream first spins on a
// host-mapped "gate" flag; the host enqueues start event, work and end event on all GPUs, then
// opens the gate, so host launch overhead and launch skew are outside the measured interval.
// time = max over GPUs of elapsed(start, end); median of --iters after --warmup.
// busbw = S*(N-1)/time (GB/s, 1e9), NCCL's all-gather / reduce-scatter busbw for per-rank size S.
// Risky variants (TMA bulk copies / bulk reductions on peer memory) run last: a sticky CUDA
// error there prints what was measured and exits non-zero.
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define CK(x) ck((x), #x, __LINE__)
static void ck(cudaError_t e, const char* what, int line) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string(cudaGetErrorString(e)) + " at line " +
                             std::to_string(line) + ": " + what);
}

constexpr int kMaxGpus = 16;
constexpr uint32_t kTile = 16 * 1024;  // TMA tile bytes
constexpr int kStages = 4;             // TMA pipeline depth (4 x 16 KiB = 64 KiB smem per CTA)
struct Xfer { const char* src[kMaxGpus]; char* dst[kMaxGpus]; };  // per-peer src/dst, by value

__device__ __forceinline__ uint64_t globalNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---------------------------------------------------------------- helper kernels
__global__ void gateKernel(const volatile unsigned* flag, unsigned epoch) {
  const uint64_t t0 = globalNs();  // 20 s safety timeout so a host failure cannot hang the GPU
  while (*flag < epoch && globalNs() - t0 < 20000000000ull) __nanosleep(200);
}
__device__ __forceinline__ uint32_t pattern(int rank, size_t w) {
  return static_cast<uint32_t>(w * 2654435761ull) ^ (0x5bd1e995u * (rank + 1));
}
__device__ __forceinline__ float chunkVal(int src, int dst, size_t i) {
  return float(src + 1) + float((i + dst) % 5);  // small integers: fp32 sums are exact
}
#define GRID_STRIDE(i, n) \
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)
__global__ void fillShard(uint32_t* s, size_t words, int g) { GRID_STRIDE(i, words) s[i] = pattern(g, i); }
__global__ void fillChunks(float* c, size_t perChunk, int n, int g) {  // chunk p = elements [p*perChunk, ..)
  GRID_STRIDE(i, perChunk * n) c[i] = chunkVal(g, int(i / perChunk), i % perChunk);
}
__global__ void checkGather(const uint32_t* out, size_t words, int n, unsigned long long* bad) {
  GRID_STRIDE(i, words * n) if (out[i] != pattern(int(i / words), i % words)) atomicAdd(bad, 1ull);
}
// acc on `owner` after `runs` pushes from all n GPUs: runs * sum_src chunkVal(src, owner, i).
__global__ void checkAcc(const float* acc, size_t nf, int n, int owner, float runs, unsigned long long* bad) {
  GRID_STRIDE(i, nf) {
    const float want = runs * (float(n * (n + 1) / 2) + float(n) * float((i + owner) % 5));
    if (fabsf(acc[i] - want) > 1e-3f * fabsf(want)) atomicAdd(bad, 1ull);
  }
}

// ---------------------------------------------------------------- SM (load/store) kernels
// Peer p = (g + y0 + blockIdx.y) % n (rotated; y = 0 is the GPU itself = local part).
// kRed: red.global.add.v4.f32 via atomicAdd(float4*, float4) (sm_90), else plain v4 stores.
// U independent 16-byte loads are in flight per thread before the stores/reductions.
template <bool kRed, int U>
__global__ void __launch_bounds__(512) smXfer(Xfer x, size_t vecs, int g, int n, int y0) {
  const int p = (g + y0 + (int)blockIdx.y) % n;
  const float4* __restrict__ s = reinterpret_cast<const float4*>(x.src[p]);
  float4* __restrict__ d = reinterpret_cast<float4*>(x.dst[p]);
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t base = blockIdx.x * (size_t)blockDim.x + threadIdx.x; base < vecs; base += stride * U) {
    float4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (base + u * stride < vecs) v[u] = s[base + u * stride];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const size_t i = base + u * stride;
      if (i < vecs) {
        if constexpr (kRed) atomicAdd(d + i, v[u]);
        else d[i] = v[u];
      }
    }
  }
}

// ---------------------------------------------------------------- TMA bulk-copy kernel (PTX)
__device__ __forceinline__ uint32_t smemAddr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ uint64_t gAddr(const void* p) { return (uint64_t)__cvta_generic_to_global(p); }
__device__ __forceinline__ void mbarInit(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase with the given parity has completed; traps after 10 s (no silent hang).
__device__ __forceinline__ void mbarWait(uint32_t bar, uint32_t parity) {
  const uint64_t t0 = globalNs();
  for (;;) {
    uint32_t done;
    asm volatile("{\n\t.reg .pred P;\n\tmbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, P;\n\t}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    if (done) return;
    if (globalNs() - t0 > 10000000000ull) __trap();
  }
}
// global -> shared, completion signalled on the mbarrier as transaction bytes.
__device__ __forceinline__ void bulkLoad(uint32_t sdst, const void* gsrc, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(sdst), "l"(gAddr(gsrc)), "r"(bytes), "r"(bar) : "memory");
}
// shared -> global copy (kRed = false) or element-wise fp32 add into global (kRed = true).
template <bool kRed>
__device__ __forceinline__ void bulkStore(void* gdst, uint32_t ssrc, uint32_t bytes) {
  if constexpr (kRed)
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
                 ::"l"(gAddr(gdst)), "r"(ssrc), "r"(bytes) : "memory");
  else
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(gAddr(gdst)), "r"(ssrc), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int K> __device__ __forceinline__ void bulkWaitRead() {  // <= K newest groups still reading smem
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(K) : "memory");
}
__device__ __forceinline__ void bulkWaitAll() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// One CTA = one elected thread driving a kStages-deep pipeline over the tiles
// t = blockIdx.x + k*gridDim.x of peer p: bulk-load src tile -> smem stage k%kStages (mbarrier),
// then bulk-store / bulk-reduce smem -> dst tile (bulk_group). Stage of tile k-1 is refilled
// with tile k-1+kStages at iteration k, after wait_group.read 1 has confirmed that store k-1
// finished reading it (store k may still be in flight): kStages-1 loads + ~1 store overlap.
// Tile k uses mbarrier phase k/kStages, so its wait parity is (k/kStages)&1.
template <bool kRed>
__global__ void __launch_bounds__(32) tmaXfer(Xfer x, size_t bytes, int g, int n) {
  extern __shared__ __align__(128) unsigned char smem[];  // kStages*kTile data, then kStages mbarriers
  if (threadIdx.x != 0) return;
  const int p = (g + (int)blockIdx.y) % n;
  const char* src = x.src[p];
  char* dst = x.dst[p];
  const size_t ntiles = bytes / kTile;  // host asserts bytes % kTile == 0
  const size_t mine = ntiles > blockIdx.x ? (ntiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  const uint32_t data = smemAddr(smem), bars = smemAddr(smem + kStages * kTile);
  auto bar = [&](size_t k) { return bars + 8u * uint32_t(k % kStages); };
  auto buf = [&](size_t k) { return data + kTile * uint32_t(k % kStages); };
  auto off = [&](size_t k) { return (blockIdx.x + k * gridDim.x) * (size_t)kTile; };
  for (int s = 0; s < kStages; ++s) mbarInit(bars + 8u * s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // inits visible to async proxy
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  auto load = [&](size_t k) { mbarArriveExpectTx(bar(k), kTile); bulkLoad(buf(k), src + off(k), kTile, bar(k)); };
  for (size_t k = 0; k < mine && k < (size_t)kStages; ++k) load(k);
  for (size_t k = 0; k < mine; ++k) {
    mbarWait(bar(k), uint32_t((k / kStages) & 1));
    bulkStore<kRed>(dst + off(k), buf(k), kTile);
    if (k >= 1 && k - 1 + kStages < mine) {
      bulkWaitRead<1>();       // store of tile k-1 has finished reading stage (k-1)%kStages
      load(k - 1 + kStages);   // same stage, next phase
    }
  }
  bulkWaitAll();  // all stores / reductions complete before the CTA (and its smem) goes away
}

// ---------------------------------------------------------------- host side
struct Gpu {
  char *shard, *out, *acc, *chunks;  // S, N*S, S, N*S bytes (allocated for the largest S)
  cudaStream_t main;
  std::vector<cudaStream_t> peer;    // one per rotation slot k (peer (g+k)%N), forked from main
  cudaEvent_t start, end, fork;
  std::vector<cudaEvent_t> join;
  unsigned long long* bad;           // verification error counter
  int sms;
};
struct Row { std::string variant, family; int n; size_t size; double ms, busbw; int verified; };  // -1: n/a

static int N = 0;
static std::vector<Gpu> G;
static volatile unsigned* gFlag = nullptr;  // host-mapped gate flag
static unsigned gEpoch = 0;
static std::vector<Row> rows;
static std::string jsonPath = "probe_nvlink.json";

static void writeJson() {
  FILE* f = fopen(jsonPath.c_str(), "w");
  if (!f) { perror(jsonPath.c_str()); return; }
  fprintf(f, "[\n");
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    fprintf(f, "  {\"variant\": \"%s\", \"family\": \"%s\", \"n_gpus\": %d, \"size_bytes\": %zu, "
            "\"ms_median\": %.6f, \"busbw_gbps\": %.3f, \"verified\": %s}%s\n", r.variant.c_str(),
            r.family.c_str(), r.n, r.size, r.ms, r.busbw,
            r.verified < 0 ? "null" : (r.verified ? "true" : "false"), i + 1 < rows.size() ? "," : "");
  }
  fprintf(f, "]\n");
  fclose(f);
}

// Host sync of every GPU's main stream (peer streams are joined into it), with a 120 s watchdog.
static void syncAll() {
  for (int g = 0; g < N; ++g) {
    CK(cudaSetDevice(g));
    const auto t0 = std::chrono::steady_clock::now();
    cudaError_t e;
    while ((e = cudaStreamQuery(G[g].main)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(120)) {
        printf("FATAL: GPU %d did not finish within 120 s (hang)\n", g);
        writeJson(); fflush(stdout); std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    CK(e);
  }
}
static void fork(int g) {
  CK(cudaEventRecord(G[g].fork, G[g].main));
  for (int k = 0; k < N; ++k) CK(cudaStreamWaitEvent(G[g].peer[k], G[g].fork, 0));
}
static void join(int g) {
  for (int k = 0; k < N; ++k) {
    CK(cudaEventRecord(G[g].join[k], G[g].peer[k]));
    CK(cudaStreamWaitEvent(G[g].main, G[g].join[k], 0));
  }
}

// One timed iteration of `launch` on all GPUs; returns max over GPUs of elapsed ms.
static float timeOnce(const std::function<void(int)>& launch) {
  syncAll();
  const unsigned epoch = ++gEpoch;
  try {
    for (int g = 0; g < N; ++g) {
      CK(cudaSetDevice(g));
      gateKernel<<<1, 1, 0, G[g].main>>>(gFlag, epoch);
      CK(cudaGetLastError());
      CK(cudaEventRecord(G[g].start, G[g].main));
      launch(g);
      CK(cudaGetLastError());
      CK(cudaEventRecord(G[g].end, G[g].main));
    }
  } catch (...) {
    *gFlag = epoch;  // open the gate so already-enqueued GPUs drain
    throw;
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *gFlag = epoch;
  syncAll();
  float worst = 0.f;
  for (int g = 0; g < N; ++g) {
    float ms;
    CK(cudaSetDevice(g));
    CK(cudaEventElapsedTime(&ms, G[g].start, G[g].end));
    worst = std::max(worst, ms);
  }
  return worst;
}

struct Variant {
  std::string name, family;  // family: "gather" | "push"
  bool verify;               // false: ceiling-only (result is not a correct reduction)
  std::function<void(int g, size_t S)> launch;
};

static Xfer gatherX(int g, size_t S) {  // src: peer shards; dst: my out slots
  Xfer x{};
  for (int p = 0; p < N; ++p) { x.src[p] = G[p].shard; x.dst[p] = G[g].out + p * S; }
  return x;
}
static Xfer pushX(int g, size_t S) {  // src: my chunk p; dst: peer p's acc
  Xfer x{};
  for (int p = 0; p < N; ++p) { x.src[p] = G[g].chunks + p * S; x.dst[p] = G[p].acc; }
  return x;
}
static int blocks(int a, int b) { return std::max(1, a / b); }  // floor(a/b), at least 1

static std::vector<Variant> makeVariants() {
  std::vector<Variant> v;
  auto ce = [](bool perPeer, bool gather) {
    return [=](int g, size_t S) {
      if (perPeer) fork(g);
      for (int k = 0; k < N; ++k) {
        const int p = (g + k) % N;
        cudaStream_t s = perPeer ? G[g].peer[k] : G[g].main;
        if (gather) CK(cudaMemcpyAsync(G[g].out + p * S, G[p].shard, S, cudaMemcpyDeviceToDevice, s));
        else CK(cudaMemcpyAsync(G[p].acc, G[g].chunks + p * S, S, cudaMemcpyDeviceToDevice, s));
      }
      if (perPeer) join(g);
    };
  };
  auto gsm = [](int blocksPerSm) {
    return [=](int g, size_t S) {
      smXfer<false, 8><<<dim3(blocks(blocksPerSm * G[g].sms, N), N), 512, 0, G[g].main>>>(gatherX(g, S), S / 16, g, N, 0);
    };
  };
  v.push_back({"G_ce", "gather", true, ce(true, true)});
  v.push_back({"G_ce1", "gather", true, ce(false, true)});
  v.push_back({"G_sm", "gather", true, gsm(2)});
  v.push_back({"G_sm4", "gather", true, gsm(4)});
  v.push_back({"P_red", "push", true, [](int g, size_t S) {  // per-peer kernels, per-peer streams
    fork(g);
    for (int k = 0; k < N; ++k)
      smXfer<true, 4><<<dim3(blocks(2 * G[g].sms, N - 1), 1), 512, 0, G[g].peer[k]>>>(pushX(g, S), S / 16, g, N, k);
    join(g);
  }});
  v.push_back({"P_red_all", "push", true, [](int g, size_t S) {
    smXfer<true, 4><<<dim3(blocks(2 * G[g].sms, N), N), 512, 0, G[g].main>>>(pushX(g, S), S / 16, g, N, 0);
  }});
  v.push_back({"P_store", "push", false, [](int g, size_t S) {
    smXfer<false, 4><<<dim3(blocks(2 * G[g].sms, N), N), 512, 0, G[g].main>>>(pushX(g, S), S / 16, g, N, 0);
  }});
  v.push_back({"P_ce", "push", false, ce(true, false)});
  // Risky: TMA bulk engines on peer (NVLink) addresses.
  const int smemBytes = kStages * kTile + 8 * kStages;
  v.push_back({"G_tma", "gather", true, [=](int g, size_t S) {
    tmaXfer<false><<<dim3(blocks(2 * G[g].sms, N), N), 32, smemBytes, G[g].main>>>(gatherX(g, S), S, g, N);
  }});
  v.push_back({"P_bulkred", "push", true, [=](int g, size_t S) {
    tmaXfer<true><<<dim3(blocks(2 * G[g].sms, N), N), 32, smemBytes, G[g].main>>>(pushX(g, S), S, g, N);
  }});
  for (int g = 0; g < N; ++g) {
    CK(cudaSetDevice(g));
    CK(cudaFuncSetAttribute(tmaXfer<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smemBytes));
    CK(cudaFuncSetAttribute(tmaXfer<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smemBytes));
  }
  return v;
}

// Resets outputs, runs warmup+iters timed iterations, verifies the accumulated result.
static Row runVariant(const Variant& v, size_t S, int warmup, int iters) {
  const bool gather = v.family == "gather";
  for (int g = 0; g < N; ++g) {
    CK(cudaSetDevice(g));
    if (gather) CK(cudaMemsetAsync(G[g].out, 0, N * S, G[g].main));
    else {
      CK(cudaMemsetAsync(G[g].acc, 0, S, G[g].main));
      fillChunks<<<4 * G[g].sms, 512, 0, G[g].main>>>((float*)G[g].chunks, S / 4, N, g);
      CK(cudaGetLastError());
    }
  }
  std::vector<float> t;
  for (int i = 0; i < warmup + iters; ++i) {
    const float ms = timeOnce([&](int g) { v.launch(g, S); });
    if (i >= warmup) t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  const double ms = iters % 2 ? t[iters / 2] : 0.5 * (t[iters / 2 - 1] + t[iters / 2]);
  int verified = -1;
  if (v.verify) {
    for (int g = 0; g < N; ++g) {
      CK(cudaSetDevice(g));
      CK(cudaMemsetAsync(G[g].bad, 0, sizeof(unsigned long long), G[g].main));
      if (gather) checkGather<<<4 * G[g].sms, 512, 0, G[g].main>>>((const uint32_t*)G[g].out, S / 4, N, G[g].bad);
      else checkAcc<<<4 * G[g].sms, 512, 0, G[g].main>>>((const float*)G[g].acc, S / 4, N, g, float(warmup + iters), G[g].bad);
      CK(cudaGetLastError());
    }
    syncAll();
    verified = 1;
    for (int g = 0; g < N; ++g) {
      unsigned long long bad = 0;
      CK(cudaSetDevice(g));
      CK(cudaMemcpy(&bad, G[g].bad, sizeof(bad), cudaMemcpyDeviceToHost));
      if (bad) { verified = 0; printf("  %s S=%zu: GPU %d has %llu wrong elements\n", v.name.c_str(), S, g, bad); }
    }
  }
  return {v.name, v.family, N, S, ms, double(S) * (N - 1) / (ms * 1e-3) / 1e9, verified};
}

static size_t parseSize(const std::string& s) {
  const char c = s.empty() ? 0 : char(toupper(s.back()));
  const size_t mult = c == 'K' ? 1ull << 10 : c == 'M' ? 1ull << 20 : c == 'G' ? 1ull << 30 : 1;
  return std::stoull(mult == 1 ? s : s.substr(0, s.size() - 1)) * mult;
}
static std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t a = 0, b;
  while ((b = s.find(',', a)) != std::string::npos) { out.push_back(s.substr(a, b - a)); a = b + 1; }
  out.push_back(s.substr(a));
  return out;
}

int main(int argc, char** argv) {
  std::vector<size_t> sizes = {16ull << 20, 64ull << 20, 256ull << 20, 1ull << 30};
  std::vector<std::string> only;
  int warmup = 3, iters = 20;
  bool problems = false;  // a variant failed (non-fatally) or did not verify: exit 4
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* val = i + 1 < argc ? argv[i + 1] : nullptr;
    if (!val) { fprintf(stderr, "%s: missing value (options: --gpus --sizes --json --only --iters --warmup)\n", a.c_str()); return 2; }
    if (a == "--gpus") N = atoi(val);
    else if (a == "--sizes") { sizes.clear(); for (auto& s : split(val)) sizes.push_back(parseSize(s)); }
    else if (a == "--json") jsonPath = val;
    else if (a == "--only") only = split(val);
    else if (a == "--iters") iters = std::max(1, atoi(val));
    else if (a == "--warmup") warmup = std::max(0, atoi(val));
    else { fprintf(stderr, "unknown option %s\n", a.c_str()); return 2; }
    ++i;
  }
  try {
    int count = 0, drv = 0, rt = 0;
    CK(cudaGetDeviceCount(&count));
    if (N <= 0) N = count;
    if (N < 2 || N > count || N > kMaxGpus) { fprintf(stderr, "need 2 <= N <= %d GPUs (visible %d)\n", kMaxGpus, count); return 2; }
    for (size_t S : sizes)
      if (S == 0 || S % kTile) { fprintf(stderr, "size %zu must be a positive multiple of %u\n", S, kTile); return 2; }
    CK(cudaDriverGetVersion(&drv)); CK(cudaRuntimeGetVersion(&rt));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (sm_%d%d, %d SMs) x %d   driver %d.%d  runtime %d.%d\n", prop.name, prop.major,
           prop.minor, prop.multiProcessorCount, N, drv / 1000, drv % 1000 / 10, rt / 1000, rt % 1000 / 10);
    const size_t maxS = *std::max_element(sizes.begin(), sizes.end());
    G.resize(N);
    for (int g = 0; g < N; ++g) {
      Gpu& d = G[g];
      CK(cudaSetDevice(g));
      for (int p = 0; p < N; ++p) {
        if (p == g) continue;
        int ok = 0;
        CK(cudaDeviceCanAccessPeer(&ok, g, p));
        if (!ok) throw std::runtime_error("no peer access " + std::to_string(g) + "->" + std::to_string(p));
        const cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
        else CK(e);
      }
      CK(cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, g));
      CK(cudaMalloc(&d.shard, maxS)); CK(cudaMalloc(&d.out, N * maxS)); CK(cudaMalloc(&d.acc, maxS));
      CK(cudaMalloc(&d.chunks, N * maxS)); CK(cudaMalloc(&d.bad, sizeof(unsigned long long)));
      CK(cudaStreamCreateWithFlags(&d.main, cudaStreamNonBlocking));
      d.peer.resize(N); d.join.resize(N);
      for (int k = 0; k < N; ++k) {
        CK(cudaStreamCreateWithFlags(&d.peer[k], cudaStreamNonBlocking));
        CK(cudaEventCreateWithFlags(&d.join[k], cudaEventDisableTiming));
      }
      CK(cudaEventCreate(&d.start)); CK(cudaEventCreate(&d.end));
      CK(cudaEventCreateWithFlags(&d.fork, cudaEventDisableTiming));
      fillShard<<<4 * d.sms, 512, 0, d.main>>>((uint32_t*)d.shard, maxS / 4, g);
      CK(cudaGetLastError());
    }
    unsigned* flag = nullptr;  // UVA: this mapped host pointer is valid on every device
    CK(cudaHostAlloc(&flag, sizeof(unsigned), cudaHostAllocMapped | cudaHostAllocPortable));
    *(gFlag = flag) = 0;
    syncAll();
    const std::vector<Variant> variants = makeVariants();
    printf("%-14s %-7s %10s %11s %12s  %s\n", "variant", "family", "size_MiB", "ms_median", "busbw_GB/s", "verified");
    for (const Variant& v : variants) {
      if (!only.empty() && std::find(only.begin(), only.end(), v.name) == only.end()) continue;
      for (size_t S : sizes) {
        try {
          const Row r = runVariant(v, S, warmup, iters);
          rows.push_back(r);
          problems |= r.verified == 0;
          printf("%-14s %-7s %10.1f %11.4f %12.2f  %s\n", r.variant.c_str(), r.family.c_str(), S / 1048576.0, r.ms,
                 r.busbw, r.verified < 0 ? "n/a (ceiling)" : (r.verified ? "yes" : "NO"));
          fflush(stdout);
          writeJson();
        } catch (const std::exception& e) {
          printf("%s failed: %s\n", v.name.c_str(), e.what());
          (void)cudaGetLastError();  // clear a non-sticky error; a sticky one shows up below
          try {  // main streams first (watchdog), then whole devices (peer streams of a broken fork)
            syncAll();
            for (int g = 0; g < N; ++g) { CK(cudaSetDevice(g)); CK(cudaDeviceSynchronize()); CK(cudaGetLastError()); }
          } catch (const std::exception& e2) {
            printf("FATAL: CUDA context unusable after %s (%s); results so far in %s\n", v.name.c_str(),
                   e2.what(), jsonPath.c_str());
            writeJson();
            return 1;
          }
          problems = true;
          break;  // skip the remaining sizes of a failed variant
        }
      }
    }
    writeJson();
    printf("wrote %s (%zu rows)%s\n", jsonPath.c_str(), rows.size(),
           problems ? "; some variants FAILED or did not verify (exit 4)" : "");
  } catch (const std::exception& e) {
    printf("FATAL: %s\n", e.what());
    writeJson();
    return 1;
  }
  return problems ? 4 : 0;
}
