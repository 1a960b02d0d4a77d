// oomguard._oomguard: the compiled half of the Python package `oomguard`.
//
// A thin layer over the C++ API with no logic of its own: what counts as a
// Python OOM and which exception class a status becomes live in
// oomguard/errors.py, which the package hands over through _install_hooks;
// the PyTorch helpers live in oomguard/torch/. Use the package
// (`import oomguard`), not this module directly.

#include "common.h"
#include "oomguard/version.h"

PYBIND11_MODULE(_oomguard, m) {
  namespace og = oomguard::python;
  m.doc() = "oomguard C++ core (use the `oomguard` package)";
  m.attr("__version__") = OOMGUARD_VERSION_STRING;
  og::RegisterErrorTranslation(m);
  og::BindGuard(m);
  og::BindCoordinator(m);
  og::BindDevice(m);
  og::BindKnowledgeBase(m);
  og::BindCheckpoint(m);
}
