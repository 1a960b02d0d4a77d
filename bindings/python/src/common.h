// Shared pieces of the oomguard._oomguard module: how Python callables are
// held and called from C++ threads that do not hold the GIL, and how errors
// cross the language boundary in both directions.
//
// Error crossings:
//   Python -> C++  a Python exception raised inside a callback the guard runs
//                  (micro, apply, reset, sync, releasers, checkpoint objects) is
//                  either an out-of-memory error, thrown on as PythonOomError
//                  (classified by the translator registered in module.cc), or
//                  anything else, carried unchanged in PythonPassthrough.
//   C++ -> Python  a non-OK Status becomes StatusError, which the exception
//                  translator turns into the class oomguard.errors picks for
//                  its code (OutOfMemoryError subclasses MemoryError, ...).
//
// Thread-safety: PyCallable may be copied, called and destroyed on any thread;
// it takes the GIL itself. Everything else here is called with the GIL held
// unless its comment says otherwise.
#ifndef OOMGUARD_BINDINGS_PYTHON_COMMON_H_
#define OOMGUARD_BINDINGS_PYTHON_COMMON_H_

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "oomguard/guard.h"
#include "oomguard/oom.h"
#include "oomguard/status.h"

namespace oomguard::python {

namespace py = pybind11;

// A Python OOM seen inside a guarded callback. Not a DeviceOomError or
// HostOomError so that incidents name the Python type
// ("torch.cuda.OutOfMemoryError"); the "python" translator maps it to an
// OomInfo by its fields, never by message. It holds no Python object: by the
// time the guard sees it, the Python exception, its traceback and the frames
// (with their tensors) are released (pytorch/pytorch#27600).
class PythonOomError : public std::exception {
 public:
  PythonOomError(OomKind kind, std::string type, std::string message, int64_t requested_bytes, bool injected,
                 FrameworkEvidence framework = {})
      : kind_(kind),
        type_(std::move(type)),
        message_(std::move(message)),
        requested_bytes_(requested_bytes),
        injected_(injected),
        framework_(std::move(framework)) {}
  const char* what() const noexcept override { return message_.c_str(); }
  OomKind kind() const { return kind_; }
  const std::string& type() const { return type_; }
  int64_t requested_bytes() const { return requested_bytes_; }
  bool injected() const { return injected_; }  // raised by fault injection
  // What the package read off the failing frames (oomguard/errors.py).
  const FrameworkEvidence& framework() const { return framework_; }

 private:
  OomKind kind_;
  std::string type_;
  std::string message_;
  int64_t requested_bytes_;
  bool injected_;
  FrameworkEvidence framework_;
};

// The Python functions the compiled module calls back into, handed over by
// the package when it is imported (oomguard/__init__.py calls
// _oomguard._install_hooks): the module never imports a Python module of
// the package itself. Each is None until installed; the module then treats
// every Python exception as a non-OOM and raises plain RuntimeErrors.
//   classify(exc) -> (kind, type name, message, requested bytes, injected) or None
//   status_error(code int, code name, message, StepReport or None) -> exception instance
//   describe_buffer(obj) -> (data pointer, element count, dtype name, CUDA device or -1)
//   injected_oom(message, kind, requested bytes) -> exception instance (a MemoryError)
// REQUIRES: the GIL is held to read or call them.
struct PythonHooks {
  py::object classify = py::none();
  py::object status_error = py::none();
  py::object describe_buffer = py::none();
  py::object injected_oom = py::none();
};
PythonHooks& Hooks();

// A non-OOM Python exception on its way through C++ back to Python.
// Deliberately not a std::exception: ClassifyException falls back to the
// message of a std::exception, and a ValueError("... out of memory ...") must
// not be taken for an OOM. An unknown type classifies as kNone, so the guard
// rethrows it and the module re-raises the original exception object with its
// traceback.
struct PythonPassthrough {
  py::error_already_set error;
  std::string type;     // "ValueError": what the guard tells the other ranks
  std::string message;  // str(exception)
};

// A non-OK Status thrown towards Python (see the translator in errors.cc).
// `report` is set when the status ended a guarded step.
class StatusError : public std::runtime_error {
 public:
  explicit StatusError(Status status, std::optional<StepReport> report = std::nullopt)
      : std::runtime_error(status.ToString()), status_(std::move(status)), report_(std::move(report)) {}
  const Status& status() const { return status_; }
  const std::optional<StepReport>& report() const { return report_; }

 private:
  Status status_;
  std::optional<StepReport> report_;
};

// Text from C++ as a Python str. Messages and names may carry bytes from a
// file (a dataset name with 0xFF, a message cut inside a UTF-8 character):
// bytes that are not UTF-8 are kept visible as \xNN (backslashreplace), so
// that converting them never raises UnicodeDecodeError in place of the error
// being reported.
inline py::str Text(std::string_view s) {
  PyObject* o = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "backslashreplace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// Whether a Python error raised in a callback whose failures the SDK reports
// and survives (cache releasers, a checkpoint object's save) is one to
// survive: an Exception. KeyboardInterrupt, SystemExit and the other
// BaseExceptions stop the program's work, and pass through the SDK unchanged.
// REQUIRES: the GIL is held.
inline bool Survivable(py::error_already_set& e) { return e.matches(PyExc_Exception); }

inline void ThrowIfError(const Status& s) {
  if (!s.ok()) throw StatusError(s);
}

template <typename T>
T ValueOrThrow(StatusOr<T> v) {
  if (!v.ok()) throw StatusError(v.status());
  return std::move(v).value();
}

// A Python callable that C++ may keep, copy and drop on any thread: the
// reference is released under the GIL by the shared_ptr's deleter.
class PyCallable {
 public:
  PyCallable() = default;
  explicit PyCallable(py::object fn)
      : fn_(new py::object(std::move(fn)), [](py::object* p) {
          py::gil_scoped_acquire gil;
          delete p;
        }) {}
  explicit operator bool() const { return fn_ != nullptr && !fn_->is_none(); }
  // REQUIRES: the GIL is held.
  const py::object& get() const { return *fn_; }

 private:
  std::shared_ptr<py::object> fn_;
};

// Turns a Python exception caught while running guarded user code into what
// the guard must see: PythonOomError for an out-of-memory error (decided by
// the installed classify hook), PythonPassthrough otherwise. Never
// returns. REQUIRES: the GIL is held; `e` is the exception being handled.
[[noreturn]] void RethrowForGuard(py::error_already_set&& e);

// Calls `fn(args...)` from a thread that may not hold the GIL and converts the
// result to R while the GIL is held (no Python object outlives the call), with
// Python errors translated for the guard as RethrowForGuard does.
template <typename R = void, typename... Args>
R CallGuarded(const PyCallable& fn, Args&&... args) {
  py::gil_scoped_acquire gil;
  std::optional<PythonOomError> oom;
  try {
    if constexpr (std::is_void_v<R>) {
      fn.get()(std::forward<Args>(args)...);
      return;
    } else {
      return fn.get()(std::forward<Args>(args)...).template cast<R>();
    }
  } catch (py::error_already_set& e) {
    // Leaving this handler destroys `e`, which drops the last reference to the
    // Python exception, its traceback and the frames it holds, before the
    // guard releases caches.
    try {
      RethrowForGuard(std::move(e));
    } catch (PythonOomError& translated) {
      oom.emplace(std::move(translated));
    }
  }
  throw std::move(*oom);
}

// Re-raises a PythonPassthrough as the original Python exception. Used where
// a guarded call returns to Python. REQUIRES: the GIL is held.
[[noreturn]] inline void Reraise(PythonPassthrough& p) { throw std::move(p.error); }

// Runs `f` with the GIL released and returns its result; a Python exception
// that a callback inside `f` carried through C++ is re-raised unchanged.
// REQUIRES: the GIL is held; `f` touches no Python object except through
// CallGuarded.
template <typename F>
auto WithoutGil(F&& f) -> decltype(f()) {
  try {
    py::gil_scoped_release release;
    return f();
  } catch (PythonPassthrough& passthrough) {
    Reraise(passthrough);
  }
}

// Registers the StatusError / PythonPassthrough translators, the "python"
// OomTranslator and _install_hooks.
void RegisterErrorTranslation(py::module_& m);

void BindGuard(py::module_& m);
void BindCoordinator(py::module_& m);
void BindDevice(py::module_& m);
void BindKnowledgeBase(py::module_& m);
void BindCheckpoint(py::module_& m);

}  // namespace oomguard::python

#endif  // OOMGUARD_BINDINGS_PYTHON_COMMON_H_
