// Out-of-band exchange of small blobs between the ranks of one group (region names, key
// digests). The backend implements it over the c10d Store; the C++ tests over files.
#pragma once

#include <chrono>
#include <exception>
#include <string>

namespace torch_odc {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists (or the timeout passes, then throws OdcTimeout).
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Non-blocking: the value of `key` if it exists. Lets a rank waiting for a peer's key also
  // notice that some rank reported a failure (instead of waiting out the whole timeout).
  virtual bool tryGet(const std::string& key, std::string& value) {
    try {
      value = get(key, std::chrono::milliseconds(1));
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }
};

}  // namespace torch_odc
