// Helpers of the multi-process C++ tests: a rendezvous over files, and running a body in
// `world` forked processes (one rank each) with each rank's failure text collected.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/rendezvous.h"
#include "engine/types.h"

namespace odc_test {

namespace fs = std::filesystem;
using torch_odc::Clock;
using torch_odc::OdcTimeout;
using torch_odc::Rendezvous;

// A rendezvous over files in a directory (the backend uses the c10d Store instead).
class FileRendezvous : public Rendezvous {
 public:
  explicit FileRendezvous(fs::path dir) : dir_(std::move(dir)) {}
  void set(const std::string& key, const std::string& value) override {
    const auto path = file(key);
    const auto tmp = path.string() + ".tmp" + std::to_string(::getpid());
    std::ofstream(tmp, std::ios::binary) << value;
    fs::rename(tmp, path);
  }
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    const auto path = file(key);
    while (!fs::exists(path)) {
      if (Clock::now() > deadline) throw OdcTimeout("rendezvous timeout on " + key);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  bool tryGet(const std::string& key, std::string& value) override {
    const auto path = file(key);
    if (!fs::exists(path)) return false;
    std::ifstream in(path, std::ios::binary);
    value.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    return true;
  }

 private:
  fs::path file(std::string key) const {
    for (auto& c : key) {
      if (c == '/') c = '_';
    }
    return dir_ / key;
  }
  fs::path dir_;
};

#define REQUIRE(cond)                                                                            \
  do {                                                                                           \
    if (!(cond))                                                                                 \
      throw std::runtime_error(std::string("requirement failed: ") + #cond + " at " + __FILE__ + \
                               ":" + std::to_string(__LINE__));                                  \
  } while (0)

// Runs body(rank, rdv) in `world` forked processes; returns each child's failure text ("" = ok).
inline std::vector<std::string> runRanks(int world,
                                         const std::function<void(int, Rendezvous&)>& body) {
  const auto dir =
      fs::temp_directory_path() / ("odc-gtest-" + std::to_string(::getpid()) + "-" +
                                   std::to_string(Clock::now().time_since_epoch().count()));
  fs::create_directories(dir);
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      std::string failure;
      try {
        FileRendezvous rdv(dir);
        body(r, rdv);
      } catch (const std::exception& e) {
        failure = e.what();
      }
      std::ofstream(dir / ("result-" + std::to_string(r))) << (failure.empty() ? "ok" : failure);
      ::_exit(failure.empty() ? 0 : 1);
    }
    pids.push_back(pid);
  }
  std::vector<std::string> out(world);
  for (int r = 0; r < world; ++r) {
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    std::ifstream in(dir / ("result-" + std::to_string(r)));
    std::stringstream ss;
    ss << in.rdbuf();
    out[r] = ss.str() == "ok" ? ""
                              : ("rank " + std::to_string(r) + ": " + ss.str() + " (exit status " +
                                 std::to_string(status) + ")");
  }
  fs::remove_all(dir);
  return out;
}

inline void expectAllOk(const std::vector<std::string>& results) {
  for (const auto& r : results) EXPECT_EQ(r, "");
}

}  // namespace odc_test
