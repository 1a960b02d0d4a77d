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

#include "oomguard/torch_budget.h"

namespace py = pybind11;
using oomguard::torch::BudgetCpuAllocator;

PYBIND11_MODULE(_budget, m) {
  m.doc() = "A byte budget on torch's CPU allocator (real torch OOMs without a GPU).";
  m.def(
      "install",
      [](int64_t budget_bytes) {
        if (budget_bytes < 0) throw py::value_error("budget_bytes must be >= 0 (0: unlimited)");
        BudgetCpuAllocator::Instance().Install(budget_bytes);
      },
      py::arg("budget_bytes"),
      "Routes torch CPU allocations through the budget (0: unlimited, counting only). Calling it "
      "again changes the budget.");
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
