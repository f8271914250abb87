// The minibatch barrier's two phases and gradient memory on the backend (OdcBackend::
// barrierArrive / barrierRelease, freeAccumulators / restoreAccumulators): the engine's calls
// on the stream of its device, as profiler ranges, errors as c10::Error.
#include <optional>

#include "backend/device.h"
#include "backend/glue.h"
#include "backend/odc_backend.h"

namespace torch_odc {

namespace {

// The stream the barrier's device work runs on: the current stream of the engine's device
// (where finalize reads the accumulators), or none on the CPU.
Stream barrierStream(Engine& eng) { return device::currentStream(eng.transport().deviceIndex()); }

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

}  // namespace torch_odc
