// The one pybind11 binding layer of torch-odc. Every C++ symbol Python sees is bound here: one
// function per area (backend, engine lifecycle, keyed collectives, barrier, stats, transport,
// KeyCalls, balance), called in that order from PYBIND11_MODULE at the end.
#include <pybind11/chrono.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/device.h"
#include "backend/key_grads.h"
#include "backend/odc_backend.h"
#include "balance/planner.h"

namespace py = pybind11;

namespace {

// Wraps a Python callable returning a c10d Backend as a C++ factory. The callable is called and
// released with the GIL held, from whichever thread first issues a CUDA collective.
torch_odc::OdcBackend::BackendFactory wrapBackendFactory(py::object fn) {
  if (fn.is_none()) {
    return nullptr;
  }
  std::shared_ptr<py::object> holder(new py::object(std::move(fn)), [](py::object* p) {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      delete p;
    }
  });
  return [holder]() {
    py::gil_scoped_acquire gil;
    return (*holder)().cast<c10::intrusive_ptr<c10d::Backend>>();
  };
}

torch_odc::DType dtypeFromName(const std::string& name) {
  if (name == "float32") return torch_odc::DType::kFloat32;
  if (name == "bfloat16") return torch_odc::DType::kBFloat16;
  if (name == "float16") return torch_odc::DType::kFloat16;
  if (name == "float64") return torch_odc::DType::kFloat64;
  throw std::invalid_argument("odc: unsupported dtype " + name);
}

py::dict statsDict(const torch_odc::EngineStats& s) {
  py::dict d;
  d["minibatches"] = s.minibatches;
  d["keyed_gathers"] = s.keyed_gathers;
  d["keyed_reduce_scatters"] = s.keyed_reduce_scatters;
  d["publishes"] = s.publishes;
  d["bytes_fetched"] = s.bytes_fetched;
  d["bytes_pushed"] = s.bytes_pushed;
  d["publish_wait_s"] = s.publish_wait_s;
  d["barrier_s"] = s.barrier_s;
  d["barrier_wait_s"] = s.barrier_wait_s;
  return d;
}

py::dict gradientMemoryDict(const torch_odc::GradientMemoryTimes& t) {
  py::dict d;
  d["frees"] = t.frees;
  d["restores"] = t.restores;
  d["free_s"] = t.free_s;
  d["free_wait_s"] = t.free_wait_s;
  d["allocate_s"] = t.allocate_s;
  d["open_s"] = t.open_s;
  d["restore_wait_s"] = t.restore_wait_s;
  d["restore_s"] = t.restore_s;
  return d;
}

// A reduce op as FSDP2 passes it: a ReduceOp.RedOpType (SUM, AVG) without pybind's implicit
// conversion, or a ReduceOp (PREMUL_SUM with its factor).
c10d::ReduceOp toReduceOp(const py::handle& op) {
  if (py::isinstance<c10d::ReduceOp::RedOpType>(op)) {
    return c10d::ReduceOp(op.cast<c10d::ReduceOp::RedOpType>());
  }
  return op.cast<c10d::ReduceOp>();
}

// One key's pushes as torch_odc's FSDP2 reduce-scatter comm object makes them: the gradient
// notes and placeholders of its parameters (KeyGrads), and the push of every trainable
// parameter in one call.
struct KeyCalls {
  KeyCalls(c10::intrusive_ptr<torch_odc::OdcBackend> b, int k, size_t num_params)
      : backend(std::move(b)), key(k), grads(num_params) {}
  c10::intrusive_ptr<torch_odc::OdcBackend> backend;
  int key;
  torch_odc::KeyGrads grads;
  // The sharded parameters given to set_placeholders and the barrier's views (set_views), as
  // the Python objects: KeyGrads gets the tensors inside them at each call (see
  // KeyGrads::setPlaceholders). Only touched with the GIL held.
  std::vector<py::object> sharded, views;

  static std::vector<at::Tensor> unpack(const std::vector<py::object>& objects) {
    std::vector<at::Tensor> out;
    out.reserve(objects.size());
    for (const auto& o : objects) out.push_back(THPVariable_Unpack(o.ptr()));
    return out;
  }
};

using BackendClass =
    py::class_<torch_odc::OdcBackend, c10d::Backend, c10::intrusive_ptr<torch_odc::OdcBackend>>;

// The c10d backend: construction and the properties torch_odc reads.
BackendClass bindBackend(py::module_& m) {
  py::module_::import("torch.distributed");  // registers c10d::Backend, the base class below
  BackendClass cls(m, "OdcBackend");
  cls.def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                      std::chrono::milliseconds timeout,
                      const c10::intrusive_ptr<c10d::Backend>& cpu_backend,
                      py::object cuda_factory) {
            return c10::make_intrusive<torch_odc::OdcBackend>(
                store, rank, size, timeout, cpu_backend,
                wrapBackendFactory(std::move(cuda_factory)));
          }),
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"),
          py::arg("cpu_backend"), py::arg("cuda_factory") = py::none())
      .def_property_readonly("timeout", &torch_odc::OdcBackend::timeout)
      .def_property_readonly("cpu_backend", &torch_odc::OdcBackend::cpuBackend)
      .def_property_readonly("cuda_backend", &torch_odc::OdcBackend::cudaBackendIfCreated)
      .def_property_readonly("is_shutdown", &torch_odc::OdcBackend::isShutdown);
  return cls;
}

// The on-demand engine's lifecycle (used by torch_odc.attach / minibatch_barrier; private API).
void bindEngineLifecycle(BackendClass& cls) {
  cls.def(
         "_connect_engine",
         [](torch_odc::OdcBackend& self, const std::vector<py::tuple>& keys, int device_index) {
           // (name, shard numel, gather dtype, per-parameter gradient numels, accum dtype
           // [, cache dtype])
           std::vector<torch_odc::KeySpec> specs;
           for (const auto& k : keys) {
             specs.push_back(torch_odc::KeySpec{k[0].cast<std::string>(), k[1].cast<size_t>(),
                                                dtypeFromName(k[2].cast<std::string>()),
                                                k[3].cast<std::vector<size_t>>(),
                                                dtypeFromName(k[4].cast<std::string>())});
             if (k.size() > 5) specs.back().cache_dtype = dtypeFromName(k[5].cast<std::string>());
           }
           py::gil_scoped_release nogil;
           self.connectEngine(specs, device_index);
         },
         py::arg("keys"), py::arg("device_index") = -1)
      .def("_disconnect_engine", &torch_odc::OdcBackend::disconnectEngine,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("_has_engine", &torch_odc::OdcBackend::hasEngine)
      .def("_cuda_transport_problem", &torch_odc::OdcBackend::cudaTransportProblem,
           py::arg("device_index"), py::call_guard<py::gil_scoped_release>(),
           "Collective: why the CUDA IPC transport cannot run on this GPU and group, or ''.");
}

// The keyed collectives FSDP2's comm objects issue: the epoch and what it published, keyed
// all-gathers and reduce-scatters, and the publication of shards.
void bindKeyedCollectives(BackendClass& cls) {
  cls.def_property_readonly(
         "_epoch", [](torch_odc::OdcBackend& self) { return self.engine("epoch")->epoch(); })
      .def("_published",
           [](torch_odc::OdcBackend& self, size_t key) {
             return self.engine("published")->publishedThisEpoch(key);
           })
      .def(
          "_keyed_all_gather",
          [](torch_odc::OdcBackend& self, int key, at::Tensor output, at::Tensor input,
             bool async_op) {
            py::gil_scoped_release nogil;
            return self.keyedAllgatherCall(key, output, input, async_op);
          },
          py::arg("key"), py::arg("output"), py::arg("input"), py::arg("async_op") = false,
          "The keyed all-gather of `key` (torch_odc's FSDP2 comm objects call it): None, or a "
          "Work with async_op.")
      .def(
          "_keyed_reduce_scatter",
          [](torch_odc::OdcBackend& self, int key, at::Tensor output, at::Tensor input,
             const py::object& op, const std::vector<uint32_t>& params, double scale,
             bool async_op) {
            const auto reduce_op = toReduceOp(op);
            py::gil_scoped_release nogil;
            return self.keyedReduceScatterCall(key, output, input, reduce_op, params, scale,
                                               async_op);
          },
          py::arg("key"), py::arg("output"), py::arg("input"), py::arg("op"),
          py::arg("params") = std::vector<uint32_t>{}, py::arg("scale") = 1.0,
          py::arg("async_op") = false,
          "The keyed reduce-scatter (push) of `key`: `params` are the parameters the input "
          "covers, in order (empty: every trainable one), `scale` a factor on top of `op`'s.")
      .def(
          "_publish_shards",
          [](torch_odc::OdcBackend& self, const std::vector<int64_t>& keys,
             const std::vector<std::vector<at::Tensor>>& sources, bool place_only) {
            py::gil_scoped_release nogil;
            return self.publishShards(keys, sources, place_only);
          },
          py::arg("keys"), py::arg("sources"), py::arg("place_only") = false,
          "Publishes the keys not yet published in this minibatch from their sharded "
          "parameters (one multi-tensor copy into the shard caches, of those not living there "
          "already; where the cache holds their dtype they move in); returns those it "
          "published. place_only: fill every key's cache, publish none (attach).")
      .def("_evict_shards", &torch_odc::OdcBackend::evictShards,
           py::call_guard<py::gil_scoped_release>(),
           "Moves the parameters living in the shard caches back into memory of their own.");
}

// The minibatch barrier and the gradient accumulators it hands over.
void bindBarrier(BackendClass& cls) {
  cls.def("_arrive", &torch_odc::OdcBackend::barrierArrive,
          py::call_guard<py::gil_scoped_release>())
      .def("_grad_params", [](torch_odc::OdcBackend& self,
                              size_t key) { return self.engine("grad params")->gradParams(key); })
      .def("_accumulator",
           [](torch_odc::OdcBackend& self, size_t key) {
             const auto held = self.engine("accumulator");
             auto& e = *held;
             const auto& spec = e.layout().key(key);
             auto options = torch::TensorOptions().dtype(torch_odc::toScalarType(spec.accum_dtype));
             if (const int dev = e.transport().deviceIndex(); dev >= 0) {
               options = options.device(torch::kCUDA, static_cast<c10::DeviceIndex>(dev));
             }
             const auto numel = static_cast<int64_t>(e.layout().offsets(key).accum_numel);
             // A unit without trainable parameters (frozen embeddings under LoRA) has no
             // accumulator; from_blob on CUDA would ask the driver about a pointer it never
             // allocated.
             if (numel == 0) return torch::empty({0}, options);
             // The view holds the accumulators' memory: a .grad kept past detach, the process
             // group's end or free_gradient_memory() stays valid.
             auto pin = e.transport().pinAccumulators();
             return torch::from_blob(
                 e.accumulator(key), {numel}, [pin](void*) mutable { pin.reset(); }, options);
           })
      .def("_accumulator_section",
           [](torch_odc::OdcBackend& self) {
             // Every key's accumulator, as one flat tensor: they lie back to back in the region
             // (alignment padding between them is never written, so it stays zero). HSDP
             // all-reduces it across replicas in a few large buckets.
             const auto held = self.engine("accumulators");
             auto& e = *held;
             const auto& layout = e.layout();
             if (layout.numKeys() == 0) return torch::empty({0});
             const auto dtype = layout.key(0).accum_dtype;
             for (size_t k = 1; k < layout.numKeys(); ++k) {
               TORCH_CHECK(layout.key(k).accum_dtype == dtype,
                           "odc: accumulators of different dtypes cannot be one section");
             }
             const size_t last = layout.numKeys() - 1;
             const size_t bytes = layout.offsets(last).accum + layout.key(last).accumBytes() -
                                  layout.offsets(0).accum;
             auto options = torch::TensorOptions().dtype(torch_odc::toScalarType(dtype));
             if (const int dev = e.transport().deviceIndex(); dev >= 0) {
               options = options.device(torch::kCUDA, static_cast<c10::DeviceIndex>(dev));
             }
             auto pin = e.transport().pinAccumulators();
             return torch::from_blob(
                 e.accumulator(0), {static_cast<int64_t>(bytes / torch_odc::elementSize(dtype))},
                 [pin](void*) mutable { pin.reset(); }, options);
           })
      .def("_release", &torch_odc::OdcBackend::barrierRelease, py::arg("zero") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("_free_accumulators", &torch_odc::OdcBackend::freeAccumulators,
           py::call_guard<py::gil_scoped_release>())
      .def("_restore_accumulators", &torch_odc::OdcBackend::restoreAccumulators,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("_accumulator_generation",
                             [](torch_odc::OdcBackend& self) {
                               return self.engine("accumulators")->accumulatorGeneration();
                             })
      .def_property_readonly("_region_span",
                             [](torch_odc::OdcBackend& self) {
                               // The own region proper (shard caches, flags), without the
                               // accumulators: (address, bytes).
                               const auto held = self.engine("region");
                               return std::make_pair(
                                   reinterpret_cast<uintptr_t>(held->transport().localPointer(0)),
                                   held->layout().accumBegin());
                             })
      .def_property_readonly("_accumulators_resident",
                             [](torch_odc::OdcBackend& self) {
                               return self.engine("accumulators")->accumulatorsResident();
                             })
      .def_property_readonly("_arrived", [](torch_odc::OdcBackend& self) {
        return self.engine("arrived")->arrived();
      });
}

// The engine's statistics: memory, per-minibatch counters and the C++ host time.
void bindEngineStats(BackendClass& cls) {
  cls.def("_stats", [](torch_odc::OdcBackend& self) {
    const auto held = self.engine("stats");
    auto& e = *held;
    py::dict d;
    d["rank"] = e.rank();
    d["minibatch"] = e.epoch();
    // Device (or shared) memory this rank holds for ODC beside the model: shard caches,
    // accumulators, flags. Not part of torch.cuda.max_memory_allocated().
    // Two allocations: the region (caches and control) and the accumulators, each as the
    // transport allocates it (the CUDA one rounds up to whole 2 MiB pages).
    const auto& layout = e.layout();
    const bool resident = e.accumulatorsResident();
    const auto& transport = e.transport();
    const size_t region = transport.allocationBytes(layout.accumBegin());
    const size_t accumulators = resident ? transport.allocationBytes(layout.accumRegionBytes()) : 0;
    d["region_bytes"] = region + accumulators;
    // The region by use: published shard caches, gradient accumulators (FSDP2's sharded
    // .grad are views of them after the barrier), and the rest (control words, flags, lock
    // words, alignment, the allocations' round-up).
    py::dict memory;
    // The caches' bytes that are the sharded parameters themselves (no second copy), and the
    // rest (a published copy).
    const size_t adopted = self.adoptedBytes();
    memory["parameter_bytes"] = adopted;
    memory["published_cache_bytes"] = e.layout().cacheBytes() - adopted;
    // 0 while free_gradient_memory() has them returned.
    memory["accumulator_bytes"] = resident ? layout.accumBytes() : 0;
    memory["control_bytes"] =
        region - layout.cacheBytes() + (resident ? accumulators - layout.accumBytes() : 0);
    d["memory"] = memory;
    // Host seconds of free_gradient_memory / restore_gradient_memory, summed over the calls.
    d["gradient_memory"] = gradientMemoryDict(e.gradientMemoryTimes());
    d["current"] = statsDict(e.currentStats());
    d["last"] = statsDict(e.lastStats());
    d["total"] = statsDict(e.totalStats());
    // The C++ share of the keyed calls' host time (seconds since the group was made).
    using HostOp = torch_odc::OdcBackend::HostOp;
    py::dict cpp;
    cpp["gather"] = self.cppHostSeconds(HostOp::kGather);
    cpp["push"] = self.cppHostSeconds(HostOp::kPush);
    cpp["publish"] = self.cppHostSeconds(HostOp::kPublish);
    d["cpp_host_s"] = cpp;
    return d;
  });
}

// Which transports this build holds.
void bindTransport(py::module_& m) {
  m.def("_has_cuda_transport", &torch_odc::device::hasCudaTransport);
}

// KeyCalls: the gradient notes and common push of one key.
void bindKeyCalls(py::module_& m) {
  py::class_<KeyCalls>(m, "KeyCalls",
                       "One key's gradient notes (C++ hooks on its unsharded parameters' "
                       "gradient accumulators), its placeholders, and its common push.")
      .def(py::init<c10::intrusive_ptr<torch_odc::OdcBackend>, int, size_t>(), py::arg("backend"),
           py::arg("key"), py::arg("num_params"))
      .def(
          "watch",
          [](KeyCalls& self, size_t index, const at::Tensor& param) {
            return self.grads.watch(index, param);
          },
          py::arg("index"), py::arg("param"),
          "Notes every gradient accumulated into `param` as one of parameter `index`; False "
          "where `param` has no gradient accumulator (not a leaf requiring grad).")
      .def("unwatch_all", [](KeyCalls& self) { self.grads.unwatchAll(); })
      .def(
          "note",
          [](KeyCalls& self, const std::vector<size_t>& indices) {
            for (const size_t i : indices) self.grads.note(i);
          },
          py::arg("indices"), "Notes these parameters as a gradient hook does (benchmarks).")
      .def(
          "pushed", [](const KeyCalls& self) { return self.grads.pushed(); },
          "The parameters that got a gradient since the last take, ascending.")
      .def(
          "take_pushed", [](KeyCalls& self) { return self.grads.takePushed(); },
          "pushed(), clearing them.")
      .def(
          "set_placeholders",
          [](KeyCalls& self, const std::vector<int64_t>& indices, const py::list& sharded,
             std::vector<at::Tensor> placeholders) {
            TORCH_CHECK(indices.size() == sharded.size(),
                        "odc: set_placeholders needs one sharded parameter per index");
            std::vector<py::object> objects;
            for (const auto& p : sharded) {
              TORCH_CHECK(THPVariable_Check(p.ptr()), "odc: set_placeholders: not a tensor");
              objects.push_back(py::reinterpret_borrow<py::object>(p));
            }
            self.grads.setPlaceholders(indices, std::move(placeholders));
            self.sharded = std::move(objects);
            self.views.clear();
          },
          py::arg("indices"), py::arg("sharded"), py::arg("placeholders"))
      .def(
          "place_all",
          [](KeyCalls& self) { return self.grads.placeAll(KeyCalls::unpack(self.sharded)); },
          "Where no parameter given to set_placeholders has a .grad: puts the placeholders "
          "there, True; else changes nothing, False.")
      .def(
          "set_views",
          [](KeyCalls& self, const py::list& views) {
            TORCH_CHECK(views.empty() || views.size() == self.sharded.size(),
                        "odc: set_views needs one view per sharded parameter");
            std::vector<py::object> objects;
            for (const auto& v : views) {
              TORCH_CHECK(THPVariable_Check(v.ptr()), "odc: set_views: not a tensor");
              objects.push_back(py::reinterpret_borrow<py::object>(v));
            }
            self.views = std::move(objects);
          },
          py::arg("views"))
      .def(
          "finalize",
          [](KeyCalls& self, const std::vector<bool>& got) {
            if (self.views.empty()) return false;
            return self.grads.finalize(KeyCalls::unpack(self.sharded), KeyCalls::unpack(self.views),
                                       got);
          },
          py::arg("got"),
          "Each parameter's .grad: its view where `got` (per parameter of the key), else None; "
          "False (nothing changed) without views.")
      .def(
          "all_grads_set",
          [](const KeyCalls& self) {
            return self.grads.allGradsSet(KeyCalls::unpack(self.sharded));
          },
          "Whether every parameter given to set_placeholders has a .grad (False without any).")
      .def(
          "push_all",
          [](KeyCalls& self, at::Tensor output, at::Tensor input, const py::handle& op,
             double scale, bool async_op) -> py::object {
            const auto reduce_op = toReduceOp(op);
            if (!self.grads.takeAll(KeyCalls::unpack(self.sharded))) return py::bool_(false);
            c10::intrusive_ptr<c10d::Work> work;
            {
              py::gil_scoped_release nogil;
              work = self.backend->keyedReduceScatterCall(self.key, output, input, reduce_op, {},
                                                          scale, async_op);
            }
            return py::cast(work);
          },
          py::arg("output"), py::arg("input"), py::arg("op"), py::arg("scale"), py::arg("async_op"),
          "The common push: where every trainable parameter, and no other, got a gradient and "
          "holds its placeholder, clears their .grad and the notes and pushes the input (every "
          "trainable parameter in key order): None, or a Work with async_op. Otherwise changes "
          "nothing and returns False.");
}

// The balance planner (csrc/balance).
void bindBalance(py::module_& m) {
  m.def(
      "_plan_balance",
      [](py::buffer lengths, py::buffer costs, int64_t world_size, int64_t max_tokens, bool micro) {
        // One-dimensional, contiguous, 8-byte buffers: int64 lengths and float64 costs.
        auto view = [](const py::buffer& buf, const char* name, bool floating) {
          py::buffer_info info = buf.request();
          const char kind = info.format.empty() ? '\0' : info.format.back();
          const bool ok_kind = floating ? kind == 'd' : (kind == 'q' || kind == 'l');
          if (info.ndim != 1 || info.itemsize != 8 || !ok_kind ||
              (info.size > 1 && info.strides[0] != 8)) {
            throw py::value_error(std::string("_plan_balance: ") + name +
                                  " must be a contiguous 1-D " + (floating ? "float64" : "int64") +
                                  " buffer");
          }
          return info;
        };
        const py::buffer_info len_info = view(lengths, "lengths", false);
        const py::buffer_info cost_info = view(costs, "costs", true);
        if (len_info.size != cost_info.size) {
          throw py::value_error("_plan_balance: lengths and costs differ in size");
        }
        torch_odc::balance::Plan plan;
        {
          py::gil_scoped_release no_gil;
          plan = torch_odc::balance::MakePlan(
              static_cast<const int64_t*>(len_info.ptr), static_cast<const double*>(cost_info.ptr),
              static_cast<size_t>(len_info.size), world_size, max_tokens,
              micro ? torch_odc::balance::Mode::kMicro : torch_odc::balance::Mode::kMini);
        }
        py::list ranks;
        for (const auto& rank : plan.microbatches) {
          py::list mbs;
          for (const auto& mb : rank) {
            py::list idx(mb.size());
            for (size_t i = 0; i < mb.size(); ++i) idx[i] = py::int_(mb[i]);
            mbs.append(std::move(idx));
          }
          ranks.append(std::move(mbs));
        }
        py::list rank_costs;
        for (double cost : plan.rank_costs) rank_costs.append(cost);
        py::list oversized;
        for (int64_t x : plan.oversized) oversized.append(x);
        return py::make_tuple(ranks, rank_costs, plan.makespan, plan.lower_bound, oversized);
      },
      py::arg("lengths"), py::arg("costs"), py::arg("world_size"),
      py::arg("max_tokens_per_microbatch"), py::arg("micro"),
      "Plans one minibatch (see torch_odc.balance.plan). Returns (microbatches, rank_costs, "
      "makespan, lower_bound, oversized). Raises ValueError on bad input.");
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-odc C++ core: on-demand communication backend and balance planner";

  BackendClass backend = bindBackend(m);
  bindEngineLifecycle(backend);
  bindKeyedCollectives(backend);
  bindBarrier(backend);
  bindEngineStats(backend);
  bindTransport(m);
  bindKeyCalls(m);
  bindBalance(m);
}
