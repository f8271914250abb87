// Plain types shared by the engine and every transport. No torch here: the engine and the
// shared-memory transport build and test without Python (CMake + GoogleTest).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace torch_odc {

enum class DType : uint8_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3, kByte = 4 };

inline size_t elementSize(DType t) {
  switch (t) {
    case DType::kFloat32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat64:
      return 8;
    case DType::kByte:
      return 1;
  }
  return 0;
}

inline const char* dtypeName(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "float32";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat16:
      return "float16";
    case DType::kFloat64:
      return "float64";
    case DType::kByte:
      return "uint8";
  }
  return "?";
}

// The accumulator dtype for pushes of `src`: 16-bit pushes are widened and added in fp32, so
// rounding to the gradient dtype happens once, when the minibatch's sum is finalized.
inline DType accumDtypeFor(DType src) {
  return src == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
}

// An opaque execution context for data movement: nullptr on the CPU, a cudaStream_t for CUDA.
using Stream = void*;

// Every error the engine raises: the message names rank, peer, key and minibatch where known.
class OdcError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class OdcTimeout : public OdcError {
 public:
  using OdcError::OdcError;
};

using Clock = std::chrono::steady_clock;

}  // namespace torch_odc
