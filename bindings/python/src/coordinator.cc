// Bindings of coordinator.h, with a trampoline so that a Python object can be
// the guard's coordinator (oomguard.torch.TorchDistributedCoordinator is one).
//
// A Python coordinator implements, with deadlines in seconds (float):
//   rank() -> int, size() -> int, engine() -> str
//   allgather(mine: numpy int64 array, deadline_s) -> sequence of size()*len(mine) ints
//   allreduce_sum(buffers: list of (buffer, scale), deadline_s) -> None
//       each buffer is the object the step's `sync` returned (a torch.Tensor,
//       a numpy array) or, for the guard's own status words, a numpy float64
//       array; sum every buffer over ranks in place, each rank's contribution
//       multiplied by its own `scale` first
//   abort() -> None
// An exception raised by a collective becomes kUnavailable (a peer did not
// answer) with the exception's type and message, which the guard turns into
// CoordinationTimeoutError; nothing is thrown into the guard.
//
// Thread-safety: the guard calls its coordinator on the stepping thread with
// the GIL released; every trampoline method takes the GIL for the Python call.

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "oomguard/coordinator.h"

namespace oomguard::python {
namespace {

double Seconds(std::chrono::milliseconds d) { return static_cast<double>(d.count()) / 1000.0; }

// REQUIRES: the GIL is held.
Status FromPythonError(const char* method, py::error_already_set& e) {
  std::string type = py::str(e.type().attr("__name__"));
  std::string what = py::str(e.value());
  return Status::Unavailable(std::string("coordinator.") + method + " raised " + type + ": " + what);
}

// A numpy view of a host buffer (no copy), valid while the caller's memory is.
// REQUIRES: the GIL is held.
py::array HostView(const SumBuffer& b) {
  py::capsule no_owner(b.data, [](void*) {});
  const py::ssize_t n = static_cast<py::ssize_t>(b.count);
  switch (b.dtype) {
    case DType::kFloat32: return py::array_t<float>({n}, {sizeof(float)}, static_cast<float*>(b.data), no_owner);
    case DType::kInt64: return py::array_t<int64_t>({n}, {sizeof(int64_t)}, static_cast<int64_t*>(b.data), no_owner);
    default: return py::array_t<double>({n}, {sizeof(double)}, static_cast<double*>(b.data), no_owner);
  }
}

class PyCoordinator : public Coordinator {
 public:
  using Coordinator::Coordinator;

  int rank() const override { PYBIND11_OVERRIDE_PURE(int, Coordinator, rank, ); }
  int size() const override { PYBIND11_OVERRIDE_PURE(int, Coordinator, size, ); }
  std::string engine() const override { PYBIND11_OVERRIDE_PURE(std::string, Coordinator, engine, ); }

  Status Allgather(std::span<const int64_t> mine, std::span<int64_t> all, std::chrono::milliseconds deadline) override {
    return Call("allgather", [&](py::function& f) -> Status {
      py::array_t<int64_t> in(static_cast<py::ssize_t>(mine.size()));
      std::copy(mine.begin(), mine.end(), in.mutable_data());
      std::vector<int64_t> out = f(in, Seconds(deadline)).cast<std::vector<int64_t>>();
      if (out.size() != all.size())
        return Status::Internal("coordinator.allgather returned " + std::to_string(out.size()) + " words, expected " +
                                std::to_string(all.size()));
      std::copy(out.begin(), out.end(), all.begin());
      return Status::Ok();
    });
  }

  Status AllreduceSum(std::span<const SumBuffer> buffers, std::chrono::milliseconds deadline) override {
    return Call("allreduce_sum", [&](py::function& f) -> Status {
      py::list items;
      for (const SumBuffer& b : buffers) {
        py::object buf = b.handle != nullptr
                             ? py::reinterpret_borrow<py::object>(static_cast<PyObject*>(const_cast<void*>(b.handle)))
                             : py::object(HostView(b));
        items.append(py::make_tuple(buf, b.scale));
      }
      f(items, Seconds(deadline));
      return Status::Ok();
    });
  }

  void Abort() override {
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const Coordinator*>(this), "abort");
      if (f) f();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("oomguard coordinator.abort");
    }
  }

 private:
  template <typename F>
  Status Call(const char* method, F&& body) {
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const Coordinator*>(this), method);
      if (!f) return Status::Unimplemented(std::string("the Python coordinator does not implement ") + method);
      return body(f);
    } catch (py::error_already_set& e) {
      return FromPythonError(method, e);
    } catch (const py::cast_error& e) {
      return Status::Internal(std::string("coordinator.") + method + " returned the wrong type: " + e.what());
    }
  }
};

}  // namespace

void BindCoordinator(py::module_& m) {
  py::class_<Coordinator, PyCoordinator, std::unique_ptr<Coordinator>>(m, "Coordinator")
      .def(py::init<>())
      .def("rank", &Coordinator::rank)
      .def("size", &Coordinator::size)
      .def("engine", &Coordinator::engine)
      .def(
          "allgather",
          [](Coordinator& c, const std::vector<int64_t>& mine, double deadline_s) {
            std::vector<int64_t> all(mine.size() * static_cast<size_t>(c.size()));
            ThrowIfError(WithoutGil([&] {
              return c.Allgather(mine, all, std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000)));
            }));
            return all;
          },
          py::arg("mine"), py::arg("deadline_s"),
          "Collective: every rank's `mine` (same length everywhere), concatenated in rank order.")
      .def("abort", [](Coordinator& c) { WithoutGil([&] { c.Abort(); }); });

  m.def("make_local_coordinator", &MakeLocalCoordinator);
  m.def(
      "make_thread_group", [](int size) { return ValueOrThrow(MakeThreadGroup(size)); }, py::arg("size"),
      "`size` coordinators sharing one group (ranks as threads of this process), one per thread.");
}

}  // namespace oomguard::python
