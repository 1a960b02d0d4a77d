// Error translation between Python and the C++ SDK (see common.h).
//
// Which Python exceptions are out-of-memory errors, and which Python class a
// status code becomes, is decided in oomguard/errors.py, which hands its
// functions over through _install_hooks: this file only moves the values across.

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

// The exception instance for a status (the installed hook's class, else a RuntimeError).
py::object StatusException(const Status& status, py::object report) {
  const std::string name(StatusCodeName(status.code()));
  // Text: a message may carry bytes that are not UTF-8 (a name read from a shard).
  if (!Hooks().status_error.is_none())
    return Hooks().status_error(static_cast<int>(status.code()), name, Text(status.message()), std::move(report));
  return py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(Text(name + ": " + status.message()));
}

}  // namespace

PythonHooks& Hooks() {
  // Leaked on purpose: the objects must not be released after the
  // interpreter is finalised.
  static auto* hooks = new PythonHooks();
  return *hooks;
}

void RethrowForGuard(py::error_already_set&& e) {
  std::optional<PythonOomError> oom;
  try {
    // The exception fetched from the interpreter may not carry its traceback
    // (Python < 3.12 keeps it apart): the classifier reads the failing
    // frames through exc.__traceback__, as a handler in Python would.
    if (!e.trace().is_none()) {
      py::object current = py::reinterpret_steal<py::object>(PyException_GetTraceback(e.value().ptr()));
      if (!current) PyException_SetTraceback(e.value().ptr(), e.trace().ptr());
    }
    // (kind, type name, message, requested bytes, injected[, evidence dict]) or None.
    py::object verdict = Hooks().classify.is_none() ? py::none() : Hooks().classify(e.value());
    if (!verdict.is_none()) {
      auto t = verdict.cast<py::tuple>();
      FrameworkEvidence framework;
      if (t.size() > 5 && !t[5].is_none()) {
        auto evidence = t[5].cast<py::dict>();
        if (evidence.contains("grad_recording") && !evidence["grad_recording"].is_none())
          framework.grad_recording = evidence["grad_recording"].cast<bool>();
        if (evidence.contains("state_copy_bytes"))
          framework.state_copy_bytes = evidence["state_copy_bytes"].cast<int64_t>();
      }
      oom.emplace(KindFromName(t[0].cast<std::string>()), t[1].cast<std::string>(), t[2].cast<std::string>(),
                  t[3].cast<int64_t>(), t[4].cast<bool>(), std::move(framework));
    }
  } catch (py::error_already_set& broken) {
    // A classifier that fails must not replace the user's error: the original
    // passes through, and the classifier's own error is reported as unraisable.
    broken.discard_as_unraisable("oomguard: classifying an exception");
  } catch (const py::cast_error&) {
    PyErr_WarnEx(PyExc_RuntimeWarning, "oomguard: the exception classifier returned a malformed verdict", 1);
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
      info.injected = err.injected();
      info.framework = err.framework();
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
      py::object exc = StatusException(err.status(), err.report() ? py::cast(*err.report()) : py::none());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const PythonOomError& err) {
      // An OOM raised in a callback that no guard was running (the Python
      // exception itself is gone by now): the unrecoverable-OOM class.
      py::object exc =
          StatusException(Status::ResourceExhausted(err.type() + ": " + err.what()), py::none());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def(
      "_install_hooks",
      [](py::object classify, py::object status_error, py::object describe_buffer, py::object injected_oom) {
        PythonHooks& h = Hooks();
        h.classify = std::move(classify);
        h.status_error = std::move(status_error);
        h.describe_buffer = std::move(describe_buffer);
        h.injected_oom = std::move(injected_oom);
      },
      py::kw_only(), py::arg("classify"), py::arg("status_error"), py::arg("describe_buffer"),
      py::arg("injected_oom"),
      "Called once by the oomguard package: the Python functions this module calls back into (common.h).");
}

}  // namespace oomguard::python
