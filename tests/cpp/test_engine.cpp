// The engine and the shared-memory transport across real processes (fork): keyed gather,
// concurrent push-accumulate, the two-phase minibatch barrier, and the errors users see.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "engine/engine.h"
#include "ranks.h"
#include "transport/shm/shm_transport.h"

namespace fs = std::filesystem;
using namespace torch_odc;
using namespace odc_test;

namespace {

std::vector<KeySpec> twoKeys() {
  return {KeySpec{"layers.0", 1000, DType::kFloat32, {1000}, DType::kFloat32, {}},
          KeySpec{"layers.1", 37, DType::kFloat32, {30, 7}, DType::kFloat32, {}}};
}

float shardValue(int rank, size_t key, uint64_t epoch, size_t i) {
  return static_cast<float>(rank * 1000 + key * 100 + epoch * 10) + static_cast<float>(i) * 0.5f;
}

std::unique_ptr<Engine> makeEngine(int rank, int world, Rendezvous& rdv, std::vector<KeySpec> keys,
                                   std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  auto engine =
      std::make_unique<Engine>(rank, world, timeout, std::make_unique<ShmTransport>(rank, world));
  engine->connect(rdv, "t", std::move(keys));
  return engine;
}

}  // namespace

TEST(Engine, GatherReadsEveryPeersPublishedShardAcrossEpochs) {
  for (int world : {2, 4}) {
    expectAllOk(runRanks(world, [world](int rank, Rendezvous& rdv) {
      auto e = makeEngine(rank, world, rdv, twoKeys());
      for (uint64_t epoch = 1; epoch <= 3; ++epoch) {
        REQUIRE(e->epoch() == epoch);
        for (size_t k = 0; k < 2; ++k) {
          const size_t n = e->layout().key(k).shard_numel;
          std::vector<float> out(n * world, -1.0f);
          std::vector<float> in(n);
          for (size_t i = 0; i < n; ++i) in[i] = shardValue(rank, k, epoch, i);
          for (int repeat = 0; repeat < 2; ++repeat) {  // later gathers reuse the publish
            e->gather(k, out.data(), in.data(), n * 4, out.size() * 4, DType::kFloat32, nullptr);
            for (int r = 0; r < world; ++r) {
              for (size_t i = 0; i < n; ++i) REQUIRE(out[r * n + i] == shardValue(r, k, epoch, i));
            }
          }
        }
        e->arrive(nullptr);
        e->release(nullptr);
      }
      REQUIRE(e->totalStats().minibatches == 3);
      REQUIRE(e->totalStats().publishes == 6);
      REQUIRE(e->totalStats().keyed_gathers == 12);
    }));
  }
}

TEST(Engine, PublishWithFillsOnlyUnpublishedCachesThenPeersReadThem) {
  for (int world : {2, 3}) {
    expectAllOk(runRanks(world, [world](int rank, Rendezvous& rdv) {
      std::vector<KeySpec> keys = twoKeys();
      keys.push_back({"layers.2", 5, DType::kFloat32, {5}, DType::kFloat32, {}});
      auto e = makeEngine(rank, world, rdv, keys);
      for (uint64_t epoch = 1; epoch <= 2; ++epoch) {
        // Key 1 is published by its own gather first (lazy), then every key in one operation:
        // the fill must see keys 0 and 2 only, and their flags, with key 1's in between, end
        // at this epoch.
        const size_t n1 = e->layout().key(1).shard_numel;
        std::vector<float> in1(n1), out1(n1 * world);
        for (size_t i = 0; i < n1; ++i) in1[i] = shardValue(rank, 1, epoch, i);
        e->gather(1, out1.data(), in1.data(), n1 * 4, out1.size() * 4, DType::kFloat32, nullptr);
        std::vector<size_t> filled;
        const auto done = e->publishWith(
            {0, 1, 2, 0},
            [&](const std::vector<size_t>& todo, const std::vector<void*>& caches) {
              REQUIRE(todo.size() == caches.size());
              for (size_t n = 0; n < todo.size(); ++n) {
                filled.push_back(todo[n]);
                auto* dst = static_cast<float*>(caches[n]);
                for (size_t i = 0; i < e->layout().key(todo[n]).shard_numel; ++i) {
                  dst[i] = shardValue(rank, todo[n], epoch, i);
                }
              }
            },
            nullptr);
        REQUIRE((filled == std::vector<size_t>{0, 2}));
        REQUIRE((done == std::vector<size_t>{0, 2}));
        REQUIRE(e->publishWith(
                     {0, 1, 2},
                     [](const auto&, const auto&) { throw std::runtime_error("filled twice"); },
                     nullptr)
                    .empty());
        for (size_t k : {0, 2}) {
          const size_t n = e->layout().key(k).shard_numel;
          std::vector<float> out(n * world, -1.0f), in(n);
          for (size_t i = 0; i < n; ++i) in[i] = shardValue(rank, k, epoch, i);
          e->gather(k, out.data(), in.data(), n * 4, out.size() * 4, DType::kFloat32, nullptr);
          for (int r = 0; r < world; ++r) {
            for (size_t i = 0; i < n; ++i) REQUIRE(out[r * n + i] == shardValue(r, k, epoch, i));
          }
        }
        e->arrive(nullptr);
        e->release(nullptr);
      }
      REQUIRE(e->totalStats().publishes == 6);
    }));
  }
}

TEST(Engine, AnFp32ShardCacheIsReadAsTheGatherDtypeRoundedAsTorchRounds) {
  // Mixed precision: the cache holds the fp32 parameters, a gather reads them as bf16 or fp16.
  // Expected bits: torch 2.11's .to(torch.bfloat16) / .to(torch.float16) of these values (ties
  // to even, overflow, subnormals, underflow to zero).
  const std::vector<float> values{1.0f,         1.0f + 0x1p-8f, 1.0f + 0x3p-8f, -2.0f,
                                  3.0e38f,      1e-40f,         65504.0f,       65520.0f,
                                  65519.0f,     0x1p-24f,       0x1p-25f,       0x3p-25f,
                                  1 + 0x1p-11f, 1 + 0x3p-11f,   6.1e-5f,        INFINITY};
  const std::vector<uint16_t> bf16{0x3f80, 0x3f80, 0x3f82, 0xc000, 0x7f62, 0x0001, 0x4780, 0x4780,
                                   0x4780, 0x3380, 0x3300, 0x33c0, 0x3f80, 0x3f80, 0x3880, 0x7f80};
  const std::vector<uint16_t> fp16{0x3c00, 0x3c04, 0x3c0c, 0xc000, 0x7c00, 0x0000, 0x7bff, 0x7c00,
                                   0x7bff, 0x0001, 0x0000, 0x0002, 0x3c00, 0x3c02, 0x03ff, 0x7c00};
  const int world = 2;
  expectAllOk(runRanks(world, [&](int rank, Rendezvous& rdv) {
    const size_t n = values.size();
    std::vector<KeySpec> keys{{"bf16", n, DType::kBFloat16, {n}, DType::kFloat32, DType::kFloat32},
                              {"fp16", n, DType::kFloat16, {n}, DType::kFloat32, DType::kFloat32}};
    auto e = makeEngine(rank, world, rdv, keys);
    REQUIRE(e->layout().cacheBytes() >= 2 * n * 4);
    e->publishWith(
        {0, 1},
        [&](const std::vector<size_t>& todo, const std::vector<void*>& caches) {
          for (size_t k = 0; k < todo.size(); ++k) std::memcpy(caches[k], values.data(), n * 4);
        },
        nullptr);
    for (size_t k = 0; k < 2; ++k) {
      // The own chunk is the input (FSDP2's copy-in); the peer's comes from its fp32 cache.
      std::vector<uint16_t> out(n * world, 0xffff);
      const auto& want = k == 0 ? bf16 : fp16;
      std::memcpy(out.data() + rank * n, want.data(), n * 2);
      e->gather(k, out.data(), out.data() + rank * n, n * 2, out.size() * 2,
                k == 0 ? DType::kBFloat16 : DType::kFloat16, nullptr);
      const int peer = 1 - rank;
      for (size_t i = 0; i < n; ++i) REQUIRE(out[peer * n + i] == want[i]);
    }
    // Only the owner's publish from its parameters can fill such a cache: a gather before it
    // is refused (the 16-bit input cannot fill it).
    e->arrive(nullptr);
    e->release(nullptr);
    std::vector<uint16_t> in(n), out(n * world);
    try {
      e->gather(0, out.data(), in.data(), n * 2, out.size() * 2, DType::kBFloat16, nullptr);
      REQUIRE(false);
    } catch (const OdcError& err) {
      REQUIRE(std::string(err.what()).find("before this rank published it") != std::string::npos);
    }
  }));
}

TEST(Engine, ConcurrentPushesAccumulateExactlyWithUnevenMicrobatchCounts) {
  const int world = 4;
  expectAllOk(runRanks(world, [world](int rank, Rendezvous& rdv) {
    // Key 0: a large parameter (several lock blocks), a frozen one (no accumulator) and a small
    // one; key 1: one small parameter. bf16 pushes land in the same fp32 accumulators.
    const size_t big = RegionLayout::kLockBlockElems * 3 + 5;
    std::vector<KeySpec> keys{{"big", big + 9, DType::kFloat32, {big, 0, 5}, DType::kFloat32, {}},
                              {"small", 3, DType::kFloat32, {3}, DType::kFloat32, {}}};
    auto e = makeEngine(rank, world, rdv, keys);
    REQUIRE(e->layout().offsets(0).accum_numel == big + 5);
    for (uint64_t epoch = 1; epoch <= 2; ++epoch) {
      // rank r runs (r + epoch) % 3 microbatches: some rank runs none. Odd ranks push only the
      // small parameter of key 0 (as FSDP2 does for parameters without a gradient), in bf16.
      auto microbatches = [&](int r) { return static_cast<int>((r + epoch) % 3); };
      auto value = [](int r, int mb) { return static_cast<float>((r + 1) * (mb + 1)); };
      for (int mb = 0; mb < microbatches(rank); ++mb) {
        if (rank % 2 == 0) {
          std::vector<float> in((big + 5) * world, value(rank, mb));
          e->push(0, in.data(), in.size(), DType::kFloat32, 0.5, {}, nullptr);
        } else {
          const uint16_t bf16 =
              static_cast<uint16_t>(std::bit_cast<uint32_t>(value(rank, mb)) >> 16);
          std::vector<uint16_t> in(5 * world, bf16);  // small integers: exact in bf16
          e->push(0, in.data(), in.size(), DType::kBFloat16, 0.5, {2}, nullptr);
        }
        std::vector<float> in(3 * world, value(rank, mb));
        e->push(1, in.data(), in.size(), DType::kFloat32, 0.5, {}, nullptr);
      }
      std::vector<std::vector<float>> shards{std::vector<float>(big + 9), std::vector<float>(3)};
      for (size_t k = 0; k < 2; ++k) {
        e->publish(k, shards[k].data(), shards[k].size() * 4, DType::kFloat32, nullptr);
      }
      e->arrive(nullptr);
      float all = 0, even = 0;
      bool any = false, any_even = false;
      for (int r = 0; r < world; ++r) {
        for (int mb = 0; mb < microbatches(r); ++mb) {
          all += 0.5f * value(r, mb);
          any = true;
          if (r % 2 == 0) {
            even += 0.5f * value(r, mb);
            any_even = true;
          }
        }
      }
      REQUIRE(e->gradParams(0) == (std::vector<bool>{any_even, false, any}));
      REQUIRE(e->gradParams(1) == std::vector<bool>{any});
      const auto* acc0 = static_cast<const float*>(e->accumulator(0));
      for (size_t i = 0; i < big; ++i) REQUIRE(acc0[i] == even);
      for (size_t i = big; i < big + 5; ++i) REQUIRE(acc0[i] == all);
      const auto* acc1 = static_cast<const float*>(e->accumulator(1));
      for (size_t i = 0; i < 3; ++i) REQUIRE(acc1[i] == all);
      // Peers may push minibatch 2 as soon as release returns: the exact sums checked in
      // minibatch 2 are what show the accumulators were zeroed in between.
      e->release(nullptr);
    }
  }));
}

TEST(Engine, APushWaitsUntilItsOwnerReleasedTheLastMinibatch) {
  // After the barrier the accumulators are the owner's gradients until it releases them (when it
  // enters the next minibatch, after its optimizer step). Rank 1 holds them for a while; rank 0
  // releases at once and pushes its next minibatch, with no gather before (nothing else orders
  // the push after rank 1's release): the push must wait, and rank 1 must see no change.
  using std::chrono::milliseconds;
  expectAllOk(runRanks(2, [](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 2, rdv, twoKeys());
    std::vector<float> a(1000), b(37), in(2000, 1.0f);
    const auto minibatch_end = [&] {
      e->publish(0, a.data(), a.size() * 4, DType::kFloat32, nullptr);
      e->publish(1, b.data(), b.size() * 4, DType::kFloat32, nullptr);
      e->arrive(nullptr);
    };
    e->push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
    minibatch_end();
    const auto* acc = static_cast<const float*>(e->accumulator(0));
    for (size_t i = 0; i < 1000; ++i) REQUIRE(acc[i] == 2.0f);
    if (rank == 1) {
      std::this_thread::sleep_for(milliseconds(600));  // a slow optimizer step reads acc
      for (size_t i = 0; i < 1000; ++i) REQUIRE(acc[i] == 2.0f);
      e->release(nullptr);
    } else {
      e->release(nullptr);
      const auto t0 = Clock::now();
      e->push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
      REQUIRE(Clock::now() - t0 >= milliseconds(300));
    }
    if (rank == 1) e->push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
    minibatch_end();
    for (size_t i = 0; i < 1000; ++i) REQUIRE(acc[i] == 2.0f);  // zeroed, then both pushes
    e->release(nullptr);
  }));
}

TEST(Engine, FreedAccumulatorsComeBackZeroedAtTheFirstPushOrBarrierAndLeaveNothingMapped) {
  // Minibatch 1: every rank pushes; after the barrier each frees its accumulators (the engine's
  // own view is refused, no segment of generation 1 is mapped or named any more). Minibatch 2:
  // ranks 0 and 1 push (each restores at its first push), rank 2 pushes nothing (it restores at
  // its barrier): the sums are exactly minibatch 2's, so the new accumulators started at zero.
  const int world = 3;
  expectAllOk(runRanks(world, [world](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, world, rdv, twoKeys());
    const std::string segment = dynamic_cast<ShmTransport&>(e->transport()).regionName() + "-a1";
    std::vector<float> a(1000), b(37);
    const auto minibatch_end = [&] {
      e->publish(0, a.data(), a.size() * 4, DType::kFloat32, nullptr);
      e->publish(1, b.data(), b.size() * 4, DType::kFloat32, nullptr);
      e->arrive(nullptr);
    };
    std::vector<float> in(1000 * world, static_cast<float>(rank + 1));
    e->push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
    minibatch_end();
    REQUIRE(static_cast<const float*>(e->accumulator(0))[999] == 6.0f);
    REQUIRE(e->accumulatorGeneration() == 1);
    e->freeAccumulators(nullptr);
    REQUIRE(!e->accumulatorsResident());
    bool refused = false;
    try {
      e->accumulator(0);
    } catch (const OdcError& err) {
      refused = std::string(err.what()).find("were freed") != std::string::npos;
    }
    REQUIRE(refused);
    std::ifstream maps("/proc/self/maps");
    std::string line;
    bool mapped = false;
    while (std::getline(maps, line)) mapped = mapped || line.find("-a1") != std::string::npos;
    REQUIRE(!mapped);
    REQUIRE(!fs::exists("/dev/shm" + segment));
    e->release(nullptr);
    if (rank < 2) e->push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
    minibatch_end();
    REQUIRE(e->accumulatorGeneration() == 2);
    const auto* acc = static_cast<const float*>(e->accumulator(0));
    for (size_t i = 0; i < 1000; ++i) REQUIRE(acc[i] == 3.0f);
    e->release(nullptr);
  }));
}

TEST(Engine, DifferentCollectiveCountsFailAtTheBarrierNamingTheLastOne) {
  const auto results = runRanks(2, [](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 2, rdv, twoKeys());
    // Rank 0 ran one more per-microbatch all-reduce than rank 1 (one more microbatch).
    for (int i = 0; i < 2 + (rank == 0); ++i) e->noteCollective("ALLREDUCE");
    std::vector<float> a(1000), b(37);
    e->publish(0, a.data(), a.size() * 4, DType::kFloat32, nullptr);
    e->publish(1, b.data(), b.size() * 4, DType::kFloat32, nullptr);
    e->arrive(nullptr);
  });
  for (const auto& r : results) {
    EXPECT_NE(r.find("different numbers of collectives"), std::string::npos) << r;
    EXPECT_NE(r.find("ALLREDUCE"), std::string::npos) << r;
    EXPECT_NE(r.find("after torch_odc.minibatch_barrier()"), std::string::npos) << r;
  }
}

TEST(Engine, WaitingForAnUnpublishedShardTimesOutNamingPeerKeyAndMinibatch) {
  const auto results = runRanks(2, [](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 2, rdv, twoKeys(), std::chrono::milliseconds(300));
    if (rank == 1) {
      rdv.get("rank0-done", std::chrono::seconds(20));  // never publishes before rank 0 gives up
      return;
    }
    std::vector<float> in(1000), out(2000);
    try {
      e->gather(0, out.data(), in.data(), 4000, 8000, DType::kFloat32, nullptr);
    } catch (const OdcTimeout& err) {
      const std::string msg = err.what();
      rdv.set("rank0-done", "1");
      REQUIRE(msg.find("rank 0") != std::string::npos);
      REQUIRE(msg.find("peer rank 1") != std::string::npos);
      REQUIRE(msg.find("'layers.0'") != std::string::npos);
      REQUIRE(msg.find("minibatch 1") != std::string::npos);
      return;
    }
    rdv.set("rank0-done", "1");
    throw std::runtime_error("gather did not time out");
  });
  expectAllOk(results);
}

TEST(Engine, BarrierTimesOutNamingTheRankThatNeverArrives) {
  expectAllOk(runRanks(3, [](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 3, rdv, twoKeys(), std::chrono::milliseconds(300));
    std::vector<std::vector<float>> shards{std::vector<float>(1000), std::vector<float>(37)};
    if (rank == 2) {  // skips the barrier
      rdv.get("others-done/0", std::chrono::seconds(20));
      rdv.get("others-done/1", std::chrono::seconds(20));
      return;
    }
    for (size_t k = 0; k < 2; ++k)
      e->publish(k, shards[k].data(), shards[k].size() * 4, DType::kFloat32, nullptr);
    try {
      e->arrive(nullptr);
    } catch (const OdcTimeout& err) {
      rdv.set("others-done/" + std::to_string(rank), "1");
      REQUIRE(std::string(err.what()).find("peer rank 2") != std::string::npos);
      REQUIRE(std::string(err.what()).find("minibatch 1") != std::string::npos);
      return;
    }
    rdv.set("others-done/" + std::to_string(rank), "1");
    throw std::runtime_error("barrier did not time out");
  }));
}

TEST(Engine, APeerThatDiesIsReportedBeforeTheTimeout) {
  const auto results = runRanks(2, [](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 2, rdv, twoKeys(), std::chrono::seconds(60));
    if (rank == 1) ::_exit(0);  // dies without publishing (its result file stays absent)
    std::vector<float> in(1000), out(2000);
    const auto t0 = Clock::now();
    try {
      e->gather(0, out.data(), in.data(), 4000, 8000, DType::kFloat32, nullptr);
    } catch (const OdcError& err) {
      REQUIRE(std::string(err.what()).find("exited") != std::string::npos);
      REQUIRE(Clock::now() - t0 < std::chrono::seconds(10));
      return;
    }
    throw std::runtime_error("gather from a dead peer did not fail");
  });
  EXPECT_EQ(results[0], "");  // rank 1 died on purpose
}

TEST(Engine, DifferentModelsOnDifferentRanksAreRejected) {
  expectAllOk(runRanks(2, [](int rank, Rendezvous& rdv) {
    auto keys = twoKeys();
    if (rank == 1) keys[1].shard_numel += 1;
    try {
      makeEngine(rank, 2, rdv, keys, std::chrono::seconds(5));
    } catch (const OdcError& err) {
      REQUIRE(std::string(err.what()).find("layers.1") != std::string::npos);
      return;
    }
    throw std::runtime_error("mismatched keys accepted");
  }));
}

TEST(Engine, WrongSizeOrDtypeIsAClearError) {
  expectAllOk(runRanks(2, [](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 2, rdv, twoKeys());
    std::vector<float> in(1001), out(2002);
    bool threw = false;
    try {
      e->gather(0, out.data(), in.data(), 4004, 8008, DType::kFloat32, nullptr);
    } catch (const OdcError& err) {
      threw = std::string(err.what()).find("4000 bytes") != std::string::npos;
    }
    REQUIRE(threw);
    threw = false;
    try {
      e->push(1, in.data(), 75, DType::kFloat32, 1.0, {}, nullptr);
    } catch (const OdcError& err) {
      threw = std::string(err.what()).find("world size 2 x 37") != std::string::npos;
    }
    REQUIRE(threw);
    threw = false;
    try {
      e->push(1, in.data(), 60, DType::kFloat64, 1.0, {0}, nullptr);
    } catch (const OdcError& err) {
      threw = std::string(err.what()).find("float64 into a float32") != std::string::npos;
    }
    REQUIRE(threw);
  }));
}

TEST(Engine, NoSharedMemoryIsLeftBehind) {
  // Each rank reports its own region's name; other tests (ctest -j) may create regions of their
  // own meanwhile, so only these names are checked, while the ranks live and after they exit.
  const auto names = fs::temp_directory_path() / ("odc-names-" + std::to_string(::getpid()));
  expectAllOk(runRanks(2, [&names](int rank, Rendezvous& rdv) {
    auto e = makeEngine(rank, 2, rdv, twoKeys());
    const std::string name = dynamic_cast<ShmTransport&>(e->transport()).regionName();
    std::ofstream(names.string() + "-" + std::to_string(rank)) << name;
    REQUIRE(!name.empty() && !fs::exists("/dev/shm" + name));
  }));
  for (int rank = 0; rank < 2; ++rank) {
    const auto path = names.string() + "-" + std::to_string(rank);
    std::ifstream in(path);
    std::string name;
    std::getline(in, name);
    fs::remove(path);
    EXPECT_FALSE(name.empty());
    EXPECT_FALSE(fs::exists("/dev/shm" + name)) << name;
  }
}

TEST(AccumulateCpu, HalfPrecisionPushesAreWidenedIntoFloatAccumulators) {
  // bf16 2^-8 * 0.5 added to 1.0: exact in fp32 (a bf16 accumulator would round it away).
  float d = 1.0f;
  const uint16_t s = 0x3b80;  // bf16 2^-8
  accumulateCpu(&d, &s, 1, DType::kBFloat16, 0.5);
  EXPECT_EQ(d, 1.0f + std::ldexp(1.0f, -9));
  // fp16: 65504 + 65504 does not overflow in fp32; a subnormal survives exactly.
  float big = 0;
  const uint16_t bigs = 0x7bff;  // 65504
  accumulateCpu(&big, &bigs, 1, DType::kFloat16, 1.0);
  accumulateCpu(&big, &bigs, 1, DType::kFloat16, 1.0);
  EXPECT_EQ(big, 131008.0f);
  float sub = 0;
  const uint16_t subs = 0x0001;  // 2^-24
  accumulateCpu(&sub, &subs, 1, DType::kFloat16, 1.0);
  EXPECT_EQ(sub, std::ldexp(1.0f, -24));
  double wide = 1.0;
  const double ws = 1e-12;
  accumulateCpu(&wide, &ws, 1, DType::kFloat64, 2.0);
  EXPECT_EQ(wide, 1.0 + 2e-12);
}
