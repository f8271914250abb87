// The engine's lifecycle on the backend and the keyed calls: the one way into the engine's
// gather and push (OdcBackend::keyedAllgatherCall / keyedReduceScatterCall, which torch_odc's
// FSDP2 comm objects and KeyCalls::push_all call).
#include <c10/util/Exception.h>

#include <cstring>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "backend/device.h"
#include "backend/glue.h"
#include "backend/odc_backend.h"
#include "transport/shm/shm_transport.h"

namespace torch_odc {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

DType toOdcDtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    case at::kDouble:
      return DType::kFloat64;
    case at::kByte:
      return DType::kByte;
    default:
      TORCH_CHECK(false, "odc: dtype ", t, " is not supported for on-demand communication");
  }
}

at::ScalarType toScalarType(DType t) {
  switch (t) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kByte:
      return at::kByte;
  }
  return at::kByte;
}

void OdcBackend::connectEngine(const std::vector<KeySpec>& keys, int device_index) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!shutdown_, "odc: rank ", rank_, ": attach after shutdown");
  TORCH_CHECK(!engine_, "odc: rank ", rank_,
              ": a model is already attached to this process group; detach it first");
  std::unique_ptr<Transport> transport;
  if (device_index < 0) {
    transport = std::make_unique<ShmTransport>(rank_, size_);
  } else {
    transport = device::makeCudaTransport(rank_, size_, device_index);
  }
  for (const auto& k : keys) {
    TORCH_CHECK(KeySpec::servable(k.cacheDtype(), k.gather_dtype), "odc: rank ", rank_, ": key '",
                k.name, "': a ", dtypeName(k.cacheDtype()), " shard cache cannot serve ",
                dtypeName(k.gather_dtype), " all-gathers");
  }
  {
    std::lock_guard<std::mutex> adopt(adopt_mu_);
    adopted_.clear();
  }
  auto engine = std::make_unique<Engine>(rank_, size_, timeout_, std::move(transport));
  // Accumulators come back after free_gradient_memory() into memory torch's caching allocator
  // may have cached meanwhile: a failed allocation returns the cache and tries once more.
  if (device_index >= 0) engine->setAllocationRetry(device::allocationRetry());
  StoreRendezvous rdv(store_);
  engineCall(
      [&] { engine->connect(rdv, "odc/engine/" + std::to_string(engine_generation_++), keys); });
  engine_ = std::move(engine);
}

void OdcBackend::disconnectEngine() {
  std::lock_guard<std::mutex> lock(mu_);
  engine_.reset();
  std::lock_guard<std::mutex> adopt(adopt_mu_);
  adopted_.clear();  // parameters still living in the region keep its memory (their pins)
}

void OdcBackend::noteCollective(c10d::OpType type) {
  std::shared_ptr<Engine> eng;
  {
    std::lock_guard<std::mutex> lock(mu_);
    eng = engine_;
  }
  if (eng) eng->noteCollective(c10d::opTypeToString(type));
}

bool OdcBackend::hasEngine() const {
  std::lock_guard<std::mutex> lock(mu_);
  return engine_ != nullptr;
}

std::shared_ptr<Engine> OdcBackend::engine(const char* op) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!engine_) {  // close() drops the engine: the shut-down case is named only here
    TORCH_CHECK(!shutdown_, "odc: rank ", rank_, ": ", op,
                " on a process group that was destroyed (destroy_process_group) or aborted: a "
                "model attached through it can no longer run; attach a model made over a live "
                "group");
    TORCH_CHECK(false, "odc: rank ", rank_, ": ", op,
                " needs a model attached with torch_odc.attach(model) on this process group");
  }
  return engine_;
}

std::string OdcBackend::cudaTransportProblem(int device_index) {
  StoreRendezvous rdv(store_);
  std::string problem;
  engineCall([&] {
    problem = device::cudaTransportProblem(rank_, size_, device_index, rdv,
                                           "odc/cuda-support/" + std::to_string(support_checks_++),
                                           timeout_);
  });
  return problem;
}

namespace {

// Keyed operations on the CPU complete before they return.
class CompletedWork : public c10d::Work {
 public:
  CompletedWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type), outputs_(std::move(outputs)) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::ofTensors());
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// The factor a reduce op applies to each rank's contribution (SUM 1, AVG 1/world, PREMUL_SUM
// its factor); other ops are refused.
double reduceScale(const c10d::ReduceOp& op, int rank, int world, const std::string& name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return 1.0;
    case c10d::ReduceOp::AVG:
      return 1.0 / world;
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(s, "odc: PREMUL_SUM without a factor");
      return s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
    }
    default:
      TORCH_CHECK(false, "odc: rank ", rank, ": keyed reduce-scatter of key '", name,
                  "' supports SUM, AVG and PREMUL_SUM, not reduce op ", static_cast<int>(op.op_));
  }
  return 1.0;
}

}  // namespace

WorkPtr OdcBackend::keyedAllgatherCall(int key, at::Tensor& output, at::Tensor& input,
                                       bool async_op) {
  HostTimer timer(*this, HostOp::kGather);
  const auto held = engine("keyed all-gather");
  OpRange range(held->opName(Engine::Op::kGather, static_cast<size_t>(key)));
  keyedAllgather(*held, key, output, input);
  return async_op ? keyedWork(c10d::OpType::_ALLGATHER_BASE, output, input) : WorkPtr();
}

WorkPtr OdcBackend::keyedReduceScatterCall(int key, at::Tensor& output, at::Tensor& input,
                                           const c10d::ReduceOp& op,
                                           const std::vector<uint32_t>& params, double scale,
                                           bool async_op) {
  HostTimer timer(*this, HostOp::kPush);
  const auto held = engine("keyed reduce-scatter");
  OpRange range(held->opName(Engine::Op::kPush, static_cast<size_t>(key)));
  keyedReduceScatter(*held, key, output, input, op, params, scale);
  return async_op ? keyedWork(c10d::OpType::_REDUCE_SCATTER_BASE, output, input) : WorkPtr();
}

void OdcBackend::keyedAllgather(Engine& eng, int key, at::Tensor& output, at::Tensor& input) {
  const Stream stream = keyedStream(eng, input, output, "all-gather", key);
  engineCall([&] { eng.transport().checkErrors(); });
  TORCH_CHECK(input.is_contiguous() && output.is_contiguous() &&
                  input.scalar_type() == output.scalar_type(),
              "odc: rank ", rank_, ": keyed all-gather needs contiguous tensors of one dtype");
  const auto dtype = toOdcDtype(input.scalar_type());
  const size_t in_bytes = input.numel() * input.element_size();
  engineCall([&] {
    eng.gather(static_cast<size_t>(key), output.data_ptr(), input.data_ptr(), in_bytes,
               output.numel() * output.element_size(), dtype, stream);
  });
}

void OdcBackend::keyedReduceScatter(Engine& eng, int key, at::Tensor& output, at::Tensor& input,
                                    const c10d::ReduceOp& op, const std::vector<uint32_t>& params,
                                    double extra_scale) {
  const auto& name = eng.layout().key(static_cast<size_t>(key)).name;
  const Stream stream = keyedStream(eng, input, output, "reduce-scatter", key);
  engineCall([&] { eng.transport().checkErrors(); });
  TORCH_CHECK(input.is_contiguous(), "odc: rank ", rank_,
              ": keyed reduce-scatter needs a contiguous input");
  TORCH_CHECK(output.numel() * size_ == input.numel(), "odc: rank ", rank_,
              ": keyed reduce-scatter of key '", name, "': output has ", output.numel(),
              " elements, input ", input.numel(), " (expected world size ", size_, " x output)");
  const double scale = reduceScale(op, rank_, size_, name);
  engineCall([&] {
    eng.push(static_cast<size_t>(key), input.data_ptr(), static_cast<size_t>(input.numel()),
             toOdcDtype(input.scalar_type()), scale * extra_scale, params, stream);
  });
  // The reduced shard arrives at the minibatch barrier; until then FSDP2 accumulates zeros
  // (into a gradient of the user's own, or a partial HSDP output). One memset on the stream,
  // without a dispatcher round per call.
  const size_t bytes = static_cast<size_t>(output.numel()) * output.element_size();
  if (!output.is_contiguous()) {
    output.zero_();
  } else if (output.is_cpu()) {
    if (bytes) std::memset(output.data_ptr(), 0, bytes);
  } else if (bytes) {
    device::zeroAsync(output.data_ptr(), bytes, stream);
  }
}

Stream OdcBackend::keyedStream(Engine& eng, const at::Tensor& a, const at::Tensor& b,
                               const char* op, int key) {
  const int device = eng.transport().deviceIndex();
  const bool on_cuda = device >= 0;
  const auto where = [&] {
    return c10::str("odc: rank ", rank_, ": keyed ", op, " of key '",
                    eng.layout().key(static_cast<size_t>(key)).name, "' on ", a.device(), " and ",
                    b.device(), ", but the model was attached on ",
                    on_cuda ? "cuda:" + std::to_string(device) : std::string("cpu"));
  };
  TORCH_CHECK(a.device() == b.device(), where());
  if (!on_cuda) {
    TORCH_CHECK(a.device().is_cpu(), where());
    return nullptr;
  }
  TORCH_CHECK(a.device().is_cuda() && a.device().index() == device, where());
  return device::currentStream(device);
}

WorkPtr OdcBackend::keyedWork(c10d::OpType type, const at::Tensor& output,
                              const at::Tensor& input) {
  if (output.is_cuda()) {
    engine("keyed work");  // raises if none is connected
    return device::eventWork(rank_, type, output, input,
                             c10::intrusive_ptr<OdcBackend>::reclaim_copy(this),
                             engine_generation_ - 1);
  }
  return c10::make_intrusive<CompletedWork>(rank_, type, std::vector<at::Tensor>{output});
}

void OdcBackend::checkDeviceErrors(int generation) {
  std::shared_ptr<Engine> eng;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!engine_ || generation != engine_generation_ - 1) return;  // detached since
    eng = engine_;
  }
  eng->transport().checkErrors();  // as the transport raises it (not as c10::Error)
}

}  // namespace torch_odc
