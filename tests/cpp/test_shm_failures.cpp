// Failure paths of the shared-memory transport across real processes: a peer that dies (in
// another PID namespace too) is seen through its life lock within milliseconds, an accumulation
// lock held by a dead or stuck peer ends in a clear error, spoofed segments are refused, and no
// segment is left in /dev/shm when attach fails.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "ranks.h"
#include "transport/shm/shm_transport.h"

using namespace torch_odc;
using namespace odc_test;

namespace {

std::vector<KeySpec> oneKey() {
  return {KeySpec{"layers.0", 1000, DType::kFloat32, {1000}, DType::kFloat32, {}}};
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// /dev/shm entries of one job (names start with /odc-<token>).
std::vector<std::string> segmentsOf(const std::string& token) {
  std::vector<std::string> out;
  for (const auto& p : fs::directory_iterator("/dev/shm")) {
    const auto n = p.path().filename().string();
    if (n.rfind("odc-" + token, 0) == 0) out.push_back(n);
  }
  return out;
}

// Polls peerAlive(peer) until false; returns the detection time (steady clock, ns).
int64_t waitUntilDead(ShmTransport& t, int peer, std::chrono::seconds limit) {
  const auto end = Clock::now() + limit;
  while (t.peerAlive(peer)) {
    if (Clock::now() > end) throw std::runtime_error("peer death not detected");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return nowNs();
}

}  // namespace

TEST(ShmLiveness, AKilledPeerIsSeenByEveryRankWithinMilliseconds) {
  const auto results = runRanks(3, [](int rank, Rendezvous& rdv) {
    ShmTransport t(rank, 3);
    t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::seconds(20));
    if (rank == 2) {
      rdv.set("kill_at", std::to_string(nowNs()));
      ::kill(::getpid(), SIGKILL);
    }
    // A live peer is never reported dead.
    for (int i = 0; i < 100; ++i) REQUIRE(t.peerAlive(1 - rank));
    const int64_t seen = waitUntilDead(t, 2, std::chrono::seconds(5));
    const int64_t killed = std::stoll(rdv.get("kill_at", std::chrono::seconds(5)));
    std::printf("rank %d saw the SIGKILLed peer dead after %.2f ms\n", rank, (seen - killed) / 1e6);
    std::fflush(stdout);
    REQUIRE(seen - killed < 1'000'000'000);
    REQUIRE(!t.peerAlive(2));        // sticky
    REQUIRE(t.peerAlive(1 - rank));  // the other observer's check did not make it look dead
    rdv.set("seen/" + std::to_string(rank), "1");
    rdv.get("seen/" + std::to_string(1 - rank), std::chrono::seconds(5));
  });
  EXPECT_EQ(results[0], "");
  EXPECT_EQ(results[1], "");
}

TEST(ShmLiveness, APeerInAnotherPidNamespaceIsSeenDeadDespiteItsPid) {
  // The peer runs as pid 1 of its own PID namespace: kill(1, 0) here would find init alive.
  const auto results = runRanks(2, [](int rank, Rendezvous& rdv) {
    if (rank == 1) {
      if (::unshare(CLONE_NEWPID) != 0) {
        rdv.set("skip", "1");
        return;
      }
      rdv.set("unshared", "1");
      const pid_t child = ::fork();  // pid 1 in the new namespace
      if (child == 0) {
        try {
          ShmTransport t(1, 2);
          t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::seconds(20));
          rdv.set("ready", std::to_string(::getpid()));
          std::this_thread::sleep_for(std::chrono::seconds(30));
        } catch (...) {
        }
        ::_exit(0);
      }
      rdv.get("ready", std::chrono::seconds(20));
      rdv.set("kill_at", std::to_string(nowNs()));
      ::kill(child, SIGKILL);
      ::waitpid(child, nullptr, 0);
      return;
    }
    std::string ignored;
    const auto end = Clock::now() + std::chrono::seconds(20);
    while (!rdv.tryGet("unshared", ignored)) {
      if (rdv.tryGet("skip", ignored)) throw std::runtime_error("skip");
      REQUIRE(Clock::now() < end);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ShmTransport t(0, 2);
    t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::seconds(20));
    REQUIRE(rdv.get("ready", std::chrono::seconds(20)) == "1");
    REQUIRE(t.peerPid(1) == 1);
    const int64_t seen = waitUntilDead(t, 1, std::chrono::seconds(5));
    const int64_t killed = std::stoll(rdv.get("kill_at", std::chrono::seconds(5)));
    std::printf("peer in another PID namespace seen dead after %.2f ms\n", (seen - killed) / 1e6);
    std::fflush(stdout);
    REQUIRE(seen - killed < 1'000'000'000);
  });
  if (contains(results[0], "skip")) GTEST_SKIP() << "no PID namespaces (needs CAP_SYS_ADMIN)";
  expectAllOk(results);
}

TEST(ShmAccumulate, ALockHeldByADeadPeerFailsNamingHolderKeyAndMinibatch) {
  const auto results = runRanks(2, [](int rank, Rendezvous& rdv) {
    Engine e(rank, 2, std::chrono::seconds(60), std::make_unique<ShmTransport>(rank, 2));
    e.connect(rdv, "t", oneKey());
    if (rank == 1) {
      rdv.get("locked", std::chrono::seconds(20));
      ::kill(::getpid(), SIGKILL);  // dies "holding" block 0 of rank 0's accumulator
    }
    // As if rank 1 had died inside its push into our accumulator: the word names rank 1.
    auto* lock = static_cast<std::atomic<uint32_t>*>(
        e.transport().localPointer(e.layout().offsets(0).first_lock));
    lock->store(2);
    rdv.set("locked", "1");
    std::vector<float> in(2000, 1.0f);
    const auto t0 = Clock::now();
    try {
      e.push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
    } catch (const OdcError& err) {
      const std::string msg = err.what();
      REQUIRE(contains(msg, "exited holding the accumulation lock of block 0 of key 'layers.0'"));
      REQUIRE(contains(msg, "rank 0's accumulator (minibatch 1)"));
      REQUIRE(contains(msg, "held by peer rank 1") && contains(msg, "restart"));
      REQUIRE(Clock::now() - t0 < std::chrono::seconds(5));
      REQUIRE(lock->load() == 2);  // never taken over
      return;
    }
    throw std::runtime_error("push under a dead holder's lock did not fail");
  });
  EXPECT_EQ(results[0], "");
}

TEST(ShmAccumulate, ALockHeldByAStuckPeerTimesOutAtTheOperationsDeadline) {
  expectAllOk(runRanks(2, [](int rank, Rendezvous& rdv) {
    Engine e(rank, 2, std::chrono::seconds(1), std::make_unique<ShmTransport>(rank, 2));
    e.connect(rdv, "t", oneKey());
    if (rank == 1) {
      rdv.get("done", std::chrono::seconds(20));  // alive, never releases the lock
      return;
    }
    auto* lock = static_cast<std::atomic<uint32_t>*>(
        e.transport().localPointer(e.layout().offsets(0).first_lock));
    lock->store(2);
    std::vector<float> in(2000, 1.0f);
    const auto t0 = Clock::now();
    std::string msg;
    try {
      e.push(0, in.data(), in.size(), DType::kFloat32, 1.0, {}, nullptr);
    } catch (const OdcTimeout& err) {
      msg = err.what();
    }
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    rdv.set("done", "1");
    REQUIRE(contains(msg, "timed out after 1.0") && contains(msg, "held by peer rank 1"));
    REQUIRE(contains(msg, "key 'layers.0'") && contains(msg, "minibatch 1"));
    REQUIRE(waited >= 0.99 && waited < 1.3);
  }));
}

namespace {

// Plays rank 0 of a job by hand: posts a token and the name of a segment created as `make` says;
// returns what rank 1's real connect raised ("" if it did not).
std::string connectAgainstFakeRank0(const std::function<std::string(const std::string&)>& make) {
  const auto dir = fs::temp_directory_path() / ("odc-spoof-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  FileRendezvous rdv(dir);
  const std::string token = "9876543210" + std::to_string(::getpid() % 1000000);
  const std::string tok16 = (token + "0000000000000000").substr(0, 16);
  rdv.set("t/shm/token", tok16);
  const std::string fake = make(tok16);
  rdv.set("t/shm/name/0", fake);
  std::string error;
  ShmTransport t(1, 2);
  const auto t0 = Clock::now();
  try {
    t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::seconds(20));
  } catch (const OdcError& e) {
    error = e.what();
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  std::string failed;
  EXPECT_TRUE(rdv.tryGet("t/shm/failed", failed));  // peers are told at once
  EXPECT_TRUE(contains(failed, "rank 1: "));
  ::shm_unlink(fake.c_str());
  EXPECT_EQ(segmentsOf(tok16), std::vector<std::string>{});  // rank 1's own region is gone
  fs::remove_all(dir);
  return error;
}

std::string makeSegment(const std::string& name, mode_t mode, size_t bytes, uid_t owner) {
  ::shm_unlink(name.c_str());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  EXPECT_EQ(::fchmod(fd, mode), 0);
  if (owner != ::geteuid()) {
    EXPECT_EQ(::fchown(fd, owner, static_cast<gid_t>(-1)), 0);
  }
  ::close(fd);
  return name;
}

}  // namespace

TEST(ShmConnect, SpoofedPeerSegmentsAreRefusedAndNothingIsLeft) {
  const size_t bytes = RegionLayout(oneKey()).accumBegin();
  const std::string pid = std::to_string(::getpid());
  auto err = connectAgainstFakeRank0([&](const std::string& tok) {
    return makeSegment("/odc-" + tok + "-" + pid + "-r0", 0644, bytes, ::geteuid());
  });
  EXPECT_TRUE(contains(err, "refusing peer rank 0's shared-memory region") &&
              contains(err, "its mode is 0644, not 0600"))
      << err;
  err = connectAgainstFakeRank0([&](const std::string& tok) {
    return makeSegment("/odc-" + tok + "-" + pid + "-r0", 0600, bytes + 4096, ::geteuid());
  });
  EXPECT_TRUE(contains(err, "bytes, not the " + std::to_string(bytes) + " bytes")) << err;
  err = connectAgainstFakeRank0([&](const std::string&) {
    return makeSegment("/odc-someone-else-r0", 0600, bytes, ::geteuid());
  });
  EXPECT_TRUE(contains(err, "not a name of this job")) << err;
  if (::geteuid() == 0) {  // only root can give a segment away
    err = connectAgainstFakeRank0([&](const std::string& tok) {
      return makeSegment("/odc-" + tok + "-" + pid + "-r0", 0600, bytes, 65534);
    });
    EXPECT_TRUE(contains(err, "owned by uid 65534, not by this user")) << err;
  }
}

TEST(ShmConnect, AFailureOnAnotherRankEndsAttachAtOnceWithoutLeftovers) {
  const auto dir = fs::temp_directory_path() / ("odc-fail-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  FileRendezvous rdv(dir);
  std::thread other([&] {  // rank 1 fails before creating anything
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    rdv.set("t/shm/failed", "rank 1: /dev/shm is full");
  });
  ShmTransport t(0, 2);
  std::string error;
  const auto t0 = Clock::now();
  try {
    t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::seconds(20));
  } catch (const OdcError& e) {
    error = e.what();
  }
  other.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  EXPECT_TRUE(contains(error, "attach failed on another rank (rank 1: /dev/shm is full)")) << error;
  EXPECT_FALSE(fs::exists("/dev/shm" + t.regionName()));
  fs::remove_all(dir);
}

TEST(ShmConnect, ARankKilledDuringAttachLeavesNoSegment) {
  // Rank 1 dies after creating its region (never unlinked by itself); rank 2 never comes. Rank 0
  // times out and unlinks every name it knows, rank 1's included.
  const auto results = runRanks(3, [](int rank, Rendezvous& rdv) {
    if (rank == 2) return;
    ShmTransport t(rank, 3);
    if (rank == 1) {
      std::thread killer([&] {
        rdv.get("t/shm/name/1", std::chrono::seconds(20));
        rdv.get("t/shm/name/0", std::chrono::seconds(20));
        std::this_thread::sleep_for(std::chrono::milliseconds(200));  // rank 0 maps ours
        ::kill(::getpid(), SIGKILL);
      });
      t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::seconds(20));
      killer.join();
      return;
    }
    std::string error;
    try {
      t.connect(rdv, "t", RegionLayout(oneKey()), std::chrono::milliseconds(1500));
    } catch (const OdcTimeout& e) {
      error = e.what();
    }
    REQUIRE(contains(error, "peer rank 2's region name"));
    REQUIRE(segmentsOf(rdv.get("t/shm/token", std::chrono::seconds(1))).empty());
  });
  EXPECT_EQ(results[0], "");
}
