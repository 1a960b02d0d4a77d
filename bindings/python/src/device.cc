// Bindings of device.h, with a trampoline so that a Python object can be the
// guard's Device: the source of the memory figures that incidents and votes
// carry, and the cache the guard releases before a retry.
// (oomguard.torch.TorchDevice is one: torch.cuda.memory_stats on CUDA, the
// budgeted CPU allocator's counts on CPU.)
//
// A Python device implements:
//   name() -> str                 "cuda:0", "cpu", ...
//   stats() -> MemoryStats        the figures now, in bytes (counts where noted)
//   release_caches() -> None      return cached, unused memory (empty_cache)
//   reset_peak() -> None          restart the peak_allocated high-water mark
// The guard never allocates through a Python device (Allocate refuses).
//
// A device is asked for figures on the recovery path and once or twice per
// step: an exception from stats() or reset_peak() is reported through
// sys.unraisablehook and read as "no figures" (zeros), never thrown into the
// guard; one from release_caches() likewise (the OOM being handled stays the
// error).
//
// Thread-safety: the guard calls its device on the stepping thread with the
// GIL released; every trampoline method takes the GIL for the Python call.

#include <cstddef>
#include <memory>
#include <string>

#include "common.h"
#include "oomguard/device.h"

namespace oomguard::python {
namespace {

class PyDevice : public Device {
 public:
  using Device::Device;

  std::string Name() const override {
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const Device*>(this), "name");
      if (f) return py::str(f());
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("oomguard device.name");
    }
    return "python";
  }

  MemoryStats Stats() const override {
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const Device*>(this), "stats");
      if (!f) return MemoryStats{};
      py::object r = f();
      // Checked here: casting None (or another type) throws pybind11's own
      // cast errors, one of which its dispatcher takes for "try the next
      // overload" and reports as incompatible arguments of Guard.step.
      if (py::isinstance<MemoryStats>(r)) return r.cast<MemoryStats>();
      PyErr_SetString(PyExc_TypeError, ("device.stats() must return oomguard.MemoryStats, not " +
                                        std::string(py::str(py::type::of(r).attr("__name__"))))
                                           .c_str());
      throw py::error_already_set();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable("oomguard device.stats");
    }
    return MemoryStats{};
  }

  void ReleaseCaches() override { CallQuietly("release_caches"); }
  void ResetPeak() override { CallQuietly("reset_peak"); }

  void* Allocate(size_t bytes) override {
    throw DeviceOomError("a Python device does not allocate for the guard (" + std::to_string(bytes) + " bytes)",
                         static_cast<int64_t>(bytes), MemoryStats{});
  }
  void Free(void*) override {}

 private:
  void CallQuietly(const char* method) {
    py::gil_scoped_acquire gil;
    try {
      py::function f = py::get_override(static_cast<const Device*>(this), method);
      if (f) f();
    } catch (py::error_already_set& e) {
      e.discard_as_unraisable((std::string("oomguard device.") + method).c_str());
    }
  }
};

}  // namespace

void BindDevice(py::module_& m) {
  py::class_<Device, PyDevice, std::unique_ptr<Device>>(m, "Device")
      .def(py::init<>())
      .def("name", &Device::Name)
      .def("stats", [](const Device& d) { return WithoutGil([&] { return d.Stats(); }); })
      .def("release_caches", [](Device& d) { WithoutGil([&] { d.ReleaseCaches(); }); })
      .def("reset_peak", [](Device& d) { WithoutGil([&] { d.ResetPeak(); }); });
}

}  // namespace oomguard::python
