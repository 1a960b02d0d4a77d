// Error translation between Python and the C++ SDK (see common.h).
//
// Which Python exceptions are out-of-memory errors, and which Python class a
// status code becomes, is decided in oomguard/errors.py: this file only moves
// the values across.

#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "common.h"
#include "oomguard/oom.h"

namespace oomguard::python {
namespace {

OomKind KindFromName(const std::string& name) {
  if (name == "device") return OomKind::kDevice;
  if (name == "workspace") return OomKind::kWorkspace;
  return OomKind::kHost;
}

py::module_ ErrorsModule() { return py::module_::import("oomguard.errors"); }

}  // namespace

void RethrowForGuard(py::error_already_set&& e) {
  std::optional<PythonOomError> oom;
  try {
    // (kind, type name, message, requested bytes) or None.
    py::object verdict = ErrorsModule().attr("_classify_for_guard")(e.value());
    if (!verdict.is_none()) {
      auto t = verdict.cast<py::tuple>();
      oom.emplace(KindFromName(t[0].cast<std::string>()), t[1].cast<std::string>(), t[2].cast<std::string>(),
                  t[3].cast<int64_t>());
    }
  } catch (py::error_already_set& broken) {
    // A classifier that fails must not replace the user's error: the original
    // passes through, and the classifier's own error is reported as unraisable.
    broken.discard_as_unraisable("oomguard.errors._classify_for_guard");
  } catch (const py::cast_error&) {
    PyErr_WarnEx(PyExc_RuntimeWarning, "oomguard.errors._classify_for_guard returned a malformed verdict", 1);
  }
  if (!oom) {
    std::string type, message;
    try {
      type = py::str(e.type().attr("__name__"));
      message = py::str(e.value());
    } catch (py::error_already_set& broken) {
      broken.discard_as_unraisable("oomguard: describing an exception");
    }
    throw PythonPassthrough{std::move(e), std::move(type), std::move(message)};
  }
  throw std::move(*oom);
}

void RegisterErrorTranslation(py::module_& m) {
  RegisterOomTranslator("python", [](std::exception_ptr e) -> std::optional<OomInfo> {
    try {
      std::rethrow_exception(e);
    } catch (const PythonOomError& err) {
      OomInfo info;
      info.kind = err.kind();
      info.exception_type = err.type();
      info.message = err.what();
      info.requested_bytes = err.requested_bytes();
      return info;
    } catch (const PythonPassthrough& p) {
      // Not an OOM; named so that the other ranks hear what stopped this one.
      OomInfo info;
      info.exception_type = p.type.empty() ? "Python exception" : p.type;
      info.message = p.message;
      return info;
    } catch (...) {
      return std::nullopt;
    }
  });

  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (PythonPassthrough& passthrough) {
      passthrough.error.restore();
    } catch (const StatusError& err) {
      py::object report = err.report() ? py::cast(*err.report()) : py::none();
      py::object exc = ErrorsModule().attr("_from_status")(static_cast<int>(err.status().code()),
                                                           std::string(StatusCodeName(err.status().code())),
                                                           Text(err.status().message()), report);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const PythonOomError& err) {
      // An OOM raised in a callback that no guard was running (the Python
      // exception itself is gone by now): the unrecoverable-OOM class.
      py::object exc = ErrorsModule().attr("_from_status")(static_cast<int>(StatusCode::kResourceExhausted),
                                                           "RESOURCE_EXHAUSTED",
                                                           Text(err.type() + ": " + err.what()), py::none());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });
  (void)m;
}

}  // namespace oomguard::python
