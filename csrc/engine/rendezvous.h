// Out-of-band exchange of small blobs between the ranks of one group (region names, key
// digests). The backend implements it over the c10d Store; the C++ tests over files.
#pragma once

#include <chrono>
#include <string>

namespace torch_odc {

class Rendezvous {
 public:
  virtual ~Rendezvous() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until `key` exists (or the timeout passes, then throws OdcTimeout).
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

}  // namespace torch_odc
