// oomguard._budget: the Python face of BudgetCpuAllocator
// (oomguard/torch_budget.h): a byte budget on torch's CPU allocator, so that
// real tensor allocations fail with torch's own out-of-memory error
// (c10::OutOfMemoryError, raised in Python as torch.cuda.OutOfMemoryError in
// torch 1.13 and torch.OutOfMemoryError in later versions). The tests and
// examples/python/train_torch.py use it to run the guard against genuine OOMs
// on machines without a GPU.
//
// Against c10 headers only: the torch extension headers would multiply this
// module's compile time for no benefit.

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "oomguard/torch_budget.h"

namespace py = pybind11;
using oomguard::torch::BudgetCpuAllocator;

PYBIND11_MODULE(_budget, m) {
  m.doc() = "A byte budget on torch's CPU allocator (real torch OOMs without a GPU).";
  m.def(
      "install",
      [](int64_t budget_bytes, bool caching_device) {
        if (budget_bytes < 0) throw py::value_error("budget_bytes must be >= 0 (0: unlimited)");
        if (caching_device && budget_bytes == 0) throw py::value_error("a caching device needs a positive budget");
        BudgetCpuAllocator::Instance().Install(budget_bytes, caching_device);
      },
      py::arg("budget_bytes"), py::arg("caching_device") = false,
      "Routes torch CPU allocations through the budget (0: unlimited, counting only). Calling it "
      "again changes the budget. caching_device: the budget is a simulated caching allocator's capacity.");
  m.def("caching_device", [] { return BudgetCpuAllocator::Instance().caching_device(); });
  m.def(
      "device_stats",
      [] {
        const oomguard::MemoryStats s = BudgetCpuAllocator::Instance().DeviceStats();
        py::dict d;
        d["total"] = s.total;
        d["free"] = s.free;
        d["allocated"] = s.allocated;
        d["reserved"] = s.reserved;
        d["peak_allocated"] = s.peak_allocated;
        d["active"] = s.active;
        d["inactive_split"] = s.inactive_split;
        d["num_alloc_retries"] = s.num_alloc_retries;
        d["num_ooms"] = s.num_ooms;
        return d;
      },
      "The caching device's figures (torch's blocks only; held memory is neither allocated nor reserved).");
  m.def("release_caches", [] { BudgetCpuAllocator::Instance().ReleaseCaches(); },
        "Returns the caching device's free segments.");
  m.def(
      "hold",
      [](int64_t nbytes) {
        try {
          return BudgetCpuAllocator::Instance().Hold(nbytes);
        } catch (const std::logic_error& e) {
          throw py::value_error(e.what());
        } catch (const c10::Error& e) {  // it does not fit: an out-of-memory error, as for a tensor
          PyErr_SetString(PyExc_MemoryError, e.what_without_backtrace());
          throw py::error_already_set();
        }
      },
      py::arg("nbytes"), "Takes nbytes of host memory outside torch against the caching device; a handle.");
  m.def("release", [](int64_t handle) { BudgetCpuAllocator::Instance().Release(handle); }, py::arg("handle"));
  m.def("held", [] { return BudgetCpuAllocator::Instance().held(); });
  m.def("uninstall", [] { BudgetCpuAllocator::Instance().Uninstall(); },
        "Restores the allocator that was installed before.");
  m.def("installed", [] { return BudgetCpuAllocator::Instance().installed(); });
  m.def("set_budget", [](int64_t budget_bytes) { BudgetCpuAllocator::Instance().set_budget(budget_bytes); },
        py::arg("budget_bytes"));
  m.def("budget", [] { return BudgetCpuAllocator::Instance().budget(); });
  m.def("allocated", [] { return BudgetCpuAllocator::Instance().allocated(); },
        "Live bytes allocated through the budget.");
  m.def("peak", [] { return BudgetCpuAllocator::Instance().peak(); });
  m.def("reset_peak", [] { BudgetCpuAllocator::Instance().ResetPeak(); });
  m.def("live_blocks", [] { return BudgetCpuAllocator::Instance().live_blocks(); },
        "Blocks alive that were allocated through the budget (installed or not since).");
  m.def("ooms", [] { return BudgetCpuAllocator::Instance().ooms(); },
        "Allocations refused since the module was loaded.");
}
