// The one pybind11 binding layer of torch-odc. Every C++ symbol Python sees is bound here.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <pybind11/chrono.h>
#include <torch/extension.h>

#include "backend/odc_backend.h"

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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch-odc C++ core: on-demand communication backend and balance planner";

  // ---- c10d backend ------------------------------------------------------------------------
  py::module_::import("torch.distributed");  // registers c10d::Backend, the base class below
  py::class_<torch_odc::OdcBackend, c10d::Backend, c10::intrusive_ptr<torch_odc::OdcBackend>>(
      m, "OdcBackend")
      .def(py::init([](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
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

  // ---- balance planner (csrc/balance) ------------------------------------------------------
}
