// What mapping a peer's freshly allocated gradient accumulators costs, by two ways of sharing
// device memory between two processes on GPU 0 (forked before CUDA starts):
//  - ipc: cudaMalloc + cudaIpcGetMemHandle in the owner, cudaIpcOpenMemHandle in the importer
//    (what the CUDA IPC transport does at every restore_gradient_memory());
//  - vmm: cuMemCreate with a POSIX file descriptor handle in the owner, the descriptor sent over
//    a Unix socket (SCM_RIGHTS), cuMemImportFromShareableHandle + cuMemMap + cuMemSetAccess in
//    the importer, into a virtual range it reserved once.
// Each round: the owner allocates N bytes, fills them with the round's byte, shares them; the
// importer maps them, checks one word, unmaps; the owner frees. Times per round in ms.
//
//   nvcc -O2 -o /tmp/probe_vmm_map benchmarks/probes/probe_vmm_map.cu -lcuda && /tmp/probe_vmm_map [N [B [M]]]
//   EXEC=1 /tmp/probe_vmm_map ...   # the importer exec'd as a program of its own
// B: bytes each process allocates (and fills) before the rounds and holds, as a training
// process holds its model and caches (default 0); M: anonymous host mappings each process
// makes first (default 0).
//   IPC_BYTES=K /tmp/probe_vmm_map ...  # the ipc mode allocates K bytes (K <= N, any K: not
//                                       # rounded to 2 MiB as N is), to time a size that is not
//                                       # a whole number of 2 MiB pages
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

double ms(std::chrono::steady_clock::time_point a) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

void rt(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

void drv(CUresult e, const char* what) {
  if (e != CUDA_SUCCESS) {
    const char* s = nullptr;
    cuGetErrorString(e, &s);
    std::fprintf(stderr, "%s: %s\n", what, s ? s : "?");
    std::exit(1);
  }
}

struct Msg {
  int mode;  // 0 ipc, 1 vmm, -1 end
  int round;
  cudaIpcMemHandle_t handle;
};

void sendMsg(int sock, const Msg& m, int fd) {
  iovec io{const_cast<Msg*>(&m), sizeof m};
  char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr h{};
  h.msg_iov = &io;
  h.msg_iovlen = 1;
  if (fd >= 0) {
    h.msg_control = ctl;
    h.msg_controllen = sizeof ctl;
    cmsghdr* c = CMSG_FIRSTHDR(&h);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  }
  if (sendmsg(sock, &h, 0) != static_cast<ssize_t>(sizeof m)) std::exit(2);
}

Msg recvMsg(int sock, int* fd) {
  Msg m{};
  iovec io{&m, sizeof m};
  char ctl[CMSG_SPACE(sizeof(int))] = {};
  msghdr h{};
  h.msg_iov = &io;
  h.msg_iovlen = 1;
  h.msg_control = ctl;
  h.msg_controllen = sizeof ctl;
  if (recvmsg(sock, &h, 0) != static_cast<ssize_t>(sizeof m)) std::exit(3);
  *fd = -1;
  if (cmsghdr* c = CMSG_FIRSTHDR(&h); c && c->cmsg_type == SCM_RIGHTS) {
    std::memcpy(fd, CMSG_DATA(c), sizeof *fd);
  }
  return m;
}

CUmemAllocationProp prop() {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  return p;
}

// The bytes the ipc mode allocates: IPC_BYTES if set, else n.
size_t ipcBytes(size_t n) {
  const char* e = std::getenv("IPC_BYTES");
  return e ? std::strtoull(e, nullptr, 10) : n;
}

void access(CUdeviceptr p, size_t n) {
  CUmemAccessDesc d{};
  d.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  d.location.id = 0;
  d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  drv(cuMemSetAccess(p, n, &d, 1), "cuMemSetAccess");
}

constexpr int kRounds = 4;

// M separate anonymous host mappings (a process with many shared libraries and arenas mapped,
// like one running torch, has thousands).
void mapHost(long count) {
  for (long i = 0; i < count; ++i) {
    void* p = mmap(nullptr, 4096 * (1 + i % 2), PROT_READ | PROT_WRITE,
                   i % 2 ? MAP_PRIVATE | MAP_ANONYMOUS : MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::exit(6);
    static_cast<char*>(p)[0] = 1;
  }
}

void hold(size_t ballast) {
  if (ballast == 0) return;
  void* p = nullptr;
  rt(cudaMalloc(&p, ballast), "cudaMalloc of the ballast");
  rt(cudaMemset(p, 1, ballast), "cudaMemset of the ballast");
  rt(cudaDeviceSynchronize(), "sync");
}

void owner(int sock, size_t n, size_t ballast) {
  rt(cudaSetDevice(0), "cudaSetDevice");
  rt(cudaFree(nullptr), "init");
  hold(ballast);
  for (int mode = 0; mode < 2; ++mode) {
    for (int r = 0; r < kRounds; ++r) {
      Msg m{mode, r, {}};
      int fd = -1;
      void* base = nullptr;
      CUmemGenericAllocationHandle h = 0;
      CUdeviceptr va = 0;
      auto t = std::chrono::steady_clock::now();
      const size_t bytes = mode == 0 ? ipcBytes(n) : n;
      if (mode == 0) {
        rt(cudaMalloc(&base, bytes), "cudaMalloc");
      } else {
        CUmemAllocationProp p = prop();
        drv(cuMemCreate(&h, n, &p, 0), "cuMemCreate");
        drv(cuMemAddressReserve(&va, n, 0, 0, 0), "cuMemAddressReserve");
        drv(cuMemMap(va, n, 0, h, 0), "cuMemMap");
        access(va, n);
        base = reinterpret_cast<void*>(va);
      }
      rt(cudaMemset(base, 0x10 + r, bytes), "cudaMemset");
      rt(cudaDeviceSynchronize(), "sync");
      const double alloc = ms(t);
      t = std::chrono::steady_clock::now();
      if (mode == 0) {
        rt(cudaIpcGetMemHandle(&m.handle, base), "cudaIpcGetMemHandle");
      } else {
        drv(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
            "cuMemExportToShareableHandle");
      }
      const double exported = ms(t);
      sendMsg(sock, m, fd);
      if (fd >= 0) close(fd);
      int ignored;
      recvMsg(sock, &ignored);  // the importer unmapped it
      t = std::chrono::steady_clock::now();
      if (mode == 0) {
        rt(cudaFree(base), "cudaFree");
      } else {
        drv(cuMemUnmap(va, n), "cuMemUnmap");
        drv(cuMemRelease(h), "cuMemRelease");
        drv(cuMemAddressFree(va, n), "cuMemAddressFree");
      }
      std::printf("owner    %-3s round %d  allocate+fill %7.2f ms  export %6.2f ms  free %6.2f ms\n",
                  mode == 0 ? "ipc" : "vmm", r, alloc, exported, ms(t));
      std::fflush(stdout);
    }
  }
  Msg end{-1, 0, {}};
  sendMsg(sock, end, -1);
}

void importer(int sock, size_t n, size_t ballast) {
  rt(cudaSetDevice(0), "cudaSetDevice");
  rt(cudaFree(nullptr), "init");
  hold(ballast);
  CUdeviceptr va = 0;  // reserved once, for every vmm round
  drv(cuMemAddressReserve(&va, n, 0, 0, 0), "cuMemAddressReserve");
  for (;;) {
    int fd = -1;
    Msg m = recvMsg(sock, &fd);
    if (m.mode < 0) break;
    void* p = nullptr;
    CUmemGenericAllocationHandle h = 0;
    double import_ms = 0, map_ms = 0, access_ms = 0;
    auto t = std::chrono::steady_clock::now();
    if (m.mode == 0) {
      rt(cudaIpcOpenMemHandle(&p, m.handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
      map_ms = ms(t);
    } else {
      drv(cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                         CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
          "cuMemImportFromShareableHandle");
      close(fd);
      import_ms = ms(t);
      t = std::chrono::steady_clock::now();
      drv(cuMemMap(va, n, 0, h, 0), "cuMemMap");
      map_ms = ms(t);
      t = std::chrono::steady_clock::now();
      access(va, n);
      access_ms = ms(t);
      p = reinterpret_cast<void*>(va);
    }
    unsigned char word[8] = {};
    t = std::chrono::steady_clock::now();
    const size_t bytes = m.mode == 0 ? ipcBytes(n) : n;
    rt(cudaMemcpy(word, static_cast<unsigned char*>(p) + bytes - 8, 8, cudaMemcpyDeviceToHost),
       "read");
    const double first_ms = ms(t);
    const bool ok = word[0] == 0x10 + m.round && word[7] == 0x10 + m.round;
    t = std::chrono::steady_clock::now();
    if (m.mode == 0) {
      rt(cudaIpcCloseMemHandle(p), "cudaIpcCloseMemHandle");
    } else {
      drv(cuMemUnmap(va, n), "cuMemUnmap");
      drv(cuMemRelease(h), "cuMemRelease");
    }
    const double close_ms = ms(t);
    std::printf("importer %-3s round %d  import %6.2f ms  map %7.2f ms  access %7.2f ms  "
                "first read %6.2f ms  close %6.2f ms  data %s\n",
                m.mode == 0 ? "ipc" : "vmm", m.round, import_ms, map_ms, access_ms, first_ms,
                close_ms, ok ? "ok" : "WRONG");
    std::fflush(stdout);
    sendMsg(sock, m, -1);
  }
  drv(cuMemAddressFree(va, n), "cuMemAddressFree");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 4 && std::strcmp(argv[1], "--importer") == 0) {  // the exec'd importer
    importer(std::atoi(argv[2]), std::strtoull(argv[3], nullptr, 10),
             std::strtoull(argv[4], nullptr, 10));
    return 0;
  }
  // EXEC=1: the importer runs as a new program (fork + exec, like two launched ranks), not as
  // a forked copy of the owner.
  const bool exec_importer = std::getenv("EXEC") && std::strcmp(std::getenv("EXEC"), "1") == 0;
  size_t n = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : (size_t{2} << 30);
  n = (n + (size_t{2} << 20) - 1) / (size_t{2} << 20) * (size_t{2} << 20);  // 2 MiB granularity
  const size_t ballast = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 0;
  const long host_maps = argc > 3 ? std::strtol(argv[3], nullptr, 10) : 0;
  mapHost(host_maps);  // before the fork: both processes have them
  std::printf("# %zu bytes (%.2f GiB; ipc mode: %zu), %d rounds per mode, %.2f GiB held by "
              "each process, %ld host mappings made\n", n, n / double(1 << 30), ipcBytes(n),
              kRounds, ballast / double(1 << 30), host_maps);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 4;
  const pid_t child = fork();
  if (child == 0) {
    close(sv[0]);
    if (exec_importer) {
      const std::string fd = std::to_string(sv[1]), bytes = std::to_string(n),
                        held = std::to_string(ballast);
      execl("/proc/self/exe", argv[0], "--importer", fd.c_str(), bytes.c_str(), held.c_str(),
            static_cast<char*>(nullptr));
      std::exit(7);
    }
    importer(sv[1], n, ballast);
    return 0;
  }
  close(sv[1]);
  owner(sv[0], n, ballast);
  int status = 0;
  waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 5;
}
