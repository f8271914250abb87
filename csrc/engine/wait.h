// Host-side waiting: spin briefly, then yield, then sleep; give up at the deadline or as soon as
// the awaited peer is known dead. Never an unbounded wait.
#pragma once

#include <thread>

#include "engine/transport.h"

namespace torch_odc {

// Waits until ready() is true. Throws OdcTimeout at ctx.deadline, OdcError if peer_alive() is
// false (checked every few milliseconds).
template <typename Ready, typename Alive>
void hostWait(Ready&& ready, Alive&& peer_alive, const WaitContext& ctx, const char* who) {
  for (int spin = 0; spin < 64; ++spin) {
    if (ready()) return;
  }
  // Yield first: with more ranks than cores the peer we wait for may need this core.
  const auto yield_until = Clock::now() + std::chrono::microseconds(50);
  while (Clock::now() < yield_until) {
    if (ready()) return;
    std::this_thread::yield();
  }
  auto next_liveness = Clock::now();
  auto sleep = std::chrono::microseconds(20);
  while (!ready()) {
    const auto now = Clock::now();
    if (now >= ctx.deadline) {
      throw OdcTimeout(std::string(who) + " timed out waiting for " + ctx.describe());
    }
    if (now >= next_liveness) {
      if (!peer_alive()) {
        throw OdcError(std::string(who) + ": the peer process exited while waiting for " +
                       ctx.describe());
      }
      next_liveness = now + std::chrono::milliseconds(5);
    }
    std::this_thread::sleep_for(sleep);
    if (sleep < std::chrono::microseconds(500)) sleep *= 2;
  }
}

}  // namespace torch_odc
