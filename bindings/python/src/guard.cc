// Bindings of guard.h, options.h, plan.h, incident.h, oom.h and faults.h.
//
// GIL: Guard.step releases the GIL for the whole C++ step, so other Python
// threads run while the guard plans, waits on its coordinator or sleeps in an
// injected delay; each callback into Python (micro, apply, reset, sync, cache
// releasers) takes it back for the duration of the call.

#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "oomguard/coordinator.h"
#include "oomguard/device.h"
#include "oomguard/dtype.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/incident.h"
#include "oomguard/knowledge_base.h"
#include "oomguard/oom.h"
#include "oomguard/options.h"
#include "oomguard/plan.h"
#include "oomguard/recovery.h"
#include "oomguard/version.h"

namespace oomguard::python {
namespace {

// A cache releaser runs on the recovery path: its own Exception is reported
// through sys.unraisablehook and never replaces the OOM being handled; a
// KeyboardInterrupt (or another BaseException) passes through, and the guard
// ends the step with it.
std::function<void()> Releaser(PyCallable fn, std::string name) {
  return [fn = std::move(fn), name = std::move(name)] {
    py::gil_scoped_acquire gil;
    try {
      fn.get()();
    } catch (py::error_already_set& e) {
      if (!Survivable(e)) RethrowForGuard(std::move(e));
      e.discard_as_unraisable(("oomguard cache releaser '" + name + "'").c_str());
    }
  };
}

// Calls the step's sync() (Python) and describes what it returned: a list of
// contiguous torch tensors or numpy arrays, summed over ranks in place. The
// objects are kept in *keep (released under the GIL when the step ends) and
// passed to a Python coordinator as the buffers themselves.
std::vector<SumBuffer> SumBuffers(const PyCallable& sync, PyCallable* keep) {
  py::gil_scoped_acquire gil;
  py::object returned = CallGuarded<py::object>(sync);
  py::list objects;
  for (py::handle h : returned) objects.append(h);
  *keep = PyCallable(objects);
  const py::object& describe = Hooks().describe_buffer;
  if (describe.is_none()) throw py::type_error("sync(): import the oomguard package before running a guarded step");
  std::vector<SumBuffer> out;
  for (py::handle obj : objects) {
    auto t = describe(obj).cast<py::tuple>();  // (data_ptr, count, dtype name, device index or -1)
    SumBuffer b;
    b.data = reinterpret_cast<void*>(t[0].cast<uintptr_t>());
    b.count = t[1].cast<int64_t>();
    auto dtype = ParseDType(t[2].cast<std::string>());
    if (!dtype) throw py::value_error("sync(): unsupported dtype " + t[2].cast<std::string>());
    b.dtype = *dtype;
    b.device = t[3].cast<int>();
    b.handle = obj.ptr();
    out.push_back(b);
  }
  return out;
}

// Raises the injected-OOM exception of the installed hook (oomguard's
// InjectedOutOfMemoryError, a MemoryError it classifies as `kind`), else a
// plain MemoryError. REQUIRES: the GIL is held.
[[noreturn]] void RaiseInjectedOom(const char* kind, const std::string& message, int64_t requested_bytes) {
  const py::object& make = Hooks().injected_oom;
  if (make.is_none()) {
    PyErr_SetString(PyExc_MemoryError, message.c_str());
    throw py::error_already_set();
  }
  py::object exc = make(message, kind, requested_bytes);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// Runs a guarded call (Step, Evaluate) without the GIL and returns its
// report; a non-OK status becomes the status's exception with the report,
// the user's own exception passes through unchanged.
template <typename F>
StepReport RunReported(F&& run) {
  StepReport report;
  Status status = WithoutGil([&] { return run(&report); });
  if (!status.ok()) throw StatusError(status, std::move(report));
  return report;
}

}  // namespace

void BindGuard(py::module_& m) {
  py::enum_<StatusCode>(m, "StatusCode")
      .value("OK", StatusCode::kOk)
      .value("CANCELLED", StatusCode::kCancelled)
      .value("UNKNOWN", StatusCode::kUnknown)
      .value("INVALID_ARGUMENT", StatusCode::kInvalidArgument)
      .value("DEADLINE_EXCEEDED", StatusCode::kDeadlineExceeded)
      .value("NOT_FOUND", StatusCode::kNotFound)
      .value("ALREADY_EXISTS", StatusCode::kAlreadyExists)
      .value("PERMISSION_DENIED", StatusCode::kPermissionDenied)
      .value("RESOURCE_EXHAUSTED", StatusCode::kResourceExhausted)
      .value("FAILED_PRECONDITION", StatusCode::kFailedPrecondition)
      .value("ABORTED", StatusCode::kAborted)
      .value("OUT_OF_RANGE", StatusCode::kOutOfRange)
      .value("UNIMPLEMENTED", StatusCode::kUnimplemented)
      .value("INTERNAL", StatusCode::kInternal)
      .value("UNAVAILABLE", StatusCode::kUnavailable)
      .value("DATA_LOSS", StatusCode::kDataLoss);

  py::class_<Status>(m, "Status")
      .def_property_readonly("ok", &Status::ok)
      .def_property_readonly("code", &Status::code)
      .def_property_readonly("message", [](const Status& s) { return Text(s.message()); })
      .def("__str__", [](const Status& s) { return Text(s.ToString()); })
      .def("__repr__", [](const Status& s) { return Text("<oomguard.Status " + s.ToString() + ">"); });

  py::enum_<Phase>(m, "Phase")
      .value("unknown", Phase::kUnknown)
      .value("data", Phase::kData)
      .value("forward", Phase::kForward)
      .value("backward", Phase::kBackward)
      .value("optimizer", Phase::kOptimizer)
      .value("commit", Phase::kCommit)
      .value("checkpoint", Phase::kCheckpoint)
      .value("init", Phase::kInit)
      .value("load", Phase::kLoad)
      .value("eval", Phase::kEval)
      .value("comm", Phase::kComm);

  py::class_<MicroBatch>(m, "MicroBatch")
      .def(py::init<>())
      .def_readwrite("index", &MicroBatch::index)
      .def_readwrite("count", &MicroBatch::count)
      .def_readwrite("offset", &MicroBatch::offset)
      .def_readwrite("size", &MicroBatch::size)
      .def_readwrite("weight", &MicroBatch::weight)
      .def_readwrite("cost", &MicroBatch::cost)
      .def_property_readonly("slice", [](const MicroBatch& mb) {
        return py::slice(mb.offset, mb.offset + mb.size, 1);
      })
      .def("__repr__", [](const MicroBatch& mb) {
        return "MicroBatch(index=" + std::to_string(mb.index) + ", count=" + std::to_string(mb.count) +
               ", offset=" + std::to_string(mb.offset) + ", size=" + std::to_string(mb.size) +
               ", weight=" + std::to_string(mb.weight) + ")";
      });

  m.def("plan_by_samples", &PlanBySamples, py::arg("n"), py::arg("limit"), py::arg("begin") = 0,
        py::arg("first_index") = 0);

  py::class_<MemoryStats>(m, "MemoryStats")
      .def(py::init<>())
      .def_readwrite("total", &MemoryStats::total)
      .def_readwrite("free", &MemoryStats::free)
      .def_readwrite("allocated", &MemoryStats::allocated)
      .def_readwrite("reserved", &MemoryStats::reserved)
      .def_readwrite("peak_allocated", &MemoryStats::peak_allocated)
      .def_readwrite("active", &MemoryStats::active)
      .def_readwrite("inactive_split", &MemoryStats::inactive_split)
      .def_readwrite("num_alloc_retries", &MemoryStats::num_alloc_retries)
      .def_readwrite("num_ooms", &MemoryStats::num_ooms);

  py::class_<RankMemory>(m, "RankMemory")
      .def(py::init<>())
      .def(py::init([](int rank, int64_t allocated, int64_t reserved, int64_t peak) {
             return RankMemory{rank, allocated, reserved, peak};
           }),
           py::arg("rank"), py::arg("allocated") = 0, py::arg("reserved") = 0, py::arg("peak_allocated") = 0)
      .def_readwrite("rank", &RankMemory::rank)
      .def_readwrite("allocated", &RankMemory::allocated)
      .def_readwrite("reserved", &RankMemory::reserved)
      .def_readwrite("peak_allocated", &RankMemory::peak_allocated);

  py::class_<Incident>(m, "Incident")
      .def_readonly("id", &Incident::id)
      .def_readonly("run_id", &Incident::run_id)
      .def_readonly("rank", &Incident::rank)
      .def_readonly("world_size", &Incident::world_size)
      .def_readonly("step", &Incident::step)
      .def_readonly("micro_index", &Incident::micro_index)
      // The vocabulary fields are strings in Python, as in JSON (incident.h).
      .def_property_readonly("phase", [](const Incident& i) { return std::string(PhaseName(i.phase)); })
      .def_property_readonly("kind", [](const Incident& i) { return std::string(IncidentKindName(i.kind)); })
      .def_readonly("exception_type", &Incident::exception_type)
      .def_readonly("message", &Incident::message)
      .def_readonly("requested_bytes", &Incident::requested_bytes)
      .def_readonly("memory", &Incident::memory)
      .def_readonly("ranks", &Incident::ranks)
      .def_readonly("micro_before", &Incident::micro_before)
      .def_readonly("micro_after", &Incident::micro_after)
      .def_property_readonly("action", [](const Incident& i) { return std::string(LadderActionName(i.action)); })
      .def_property_readonly("actions",
                             [](const Incident& i) {
                               std::vector<std::string> names;
                               for (LadderAction a : i.actions) names.emplace_back(LadderActionName(a));
                               return names;
                             })
      .def_property_readonly("outcome",
                             [](const Incident& i) { return std::string(IncidentOutcomeName(i.outcome)); })
      .def_readonly("recovery_ms", &Incident::recovery_ms)
      .def_readonly("workload", &Incident::workload)
      .def_readonly("injected", &Incident::injected)
      .def_property_readonly("grad_recording",
                             [](const Incident& i) -> py::object {
                               return i.framework.grad_recording ? py::cast(*i.framework.grad_recording) : py::none();
                             },
                             "True when tensors of the failing frames were recording autograd graphs; None: not known.")
      .def_property_readonly("state_copy_bytes", [](const Incident& i) { return i.framework.state_copy_bytes; },
                             "Bytes of live tensors outside the model copying its state (a loaded checkpoint).")
      .def_readonly("step_peaks", &Incident::step_peaks)
      .def_readonly("steps_ok_before", &Incident::steps_ok_before)
      .def_readonly("pattern", &Incident::pattern)
      .def_readonly("confidence", &Incident::confidence)
      .def_readonly("evidence", &Incident::evidence)
      .def_readonly("remedies", &Incident::remedies)
      .def_readonly("fingerprint", &Incident::fingerprint)
      .def("to_json", [](const Incident& i) { return IncidentToJson(i); })
      .def("__repr__", [](const Incident& i) {
        return "<oomguard.Incident " + i.id + " " + std::string(IncidentKindName(i.kind)) + " " +
               std::string(PhaseName(i.phase)) + " step=" + std::to_string(i.step) +
               " action=" + std::string(LadderActionName(i.action)) +
               " outcome=" + std::string(IncidentOutcomeName(i.outcome)) + ">";
      });

  py::class_<StepReport>(m, "StepReport")
      .def_readonly("step", &StepReport::step)
      .def_readonly("status", &StepReport::status)
      .def_readonly("micro_batches", &StepReport::micro_batches)
      .def_readonly("limit_before", &StepReport::limit_before)
      .def_readonly("limit_after", &StepReport::limit_after)
      .def_readonly("largest_micro", &StepReport::largest_micro)
      .def_readonly("ooms", &StepReport::ooms)
      .def_readonly("cache_releases", &StepReport::cache_releases)
      .def_readonly("replans", &StepReport::replans)
      .def_readonly("redone", &StepReport::redone)
      .def_readonly("rolled_back_to", &StepReport::rolled_back_to)
      .def_readonly("failed_rank", &StepReport::failed_rank)
      .def_readonly("global_units", &StepReport::global_units)
      .def_readonly("checkpoint_step", &StepReport::checkpoint_step)
      .def_readonly("incidents", &StepReport::incidents)
      .def_readonly("peak_allocated", &StepReport::peak_allocated)
      .def_readonly("wall_ms", &StepReport::wall_ms)
      .def_readonly("recovery_ms", &StepReport::recovery_ms)
      .def("__repr__", [](const StepReport& r) {
        return "<oomguard.StepReport step=" + std::to_string(r.step) + " " + r.status.ToString() +
               " micro_batches=" + std::to_string(r.micro_batches) + " ooms=" + std::to_string(r.ooms) +
               " limit_after=" + std::to_string(r.limit_after) + ">";
      });

  py::class_<GuardOptions>(m, "GuardOptions")
      .def(py::init<>())
      .def_readwrite("initial_micro_batch", &GuardOptions::initial_micro_batch)
      .def_readwrite("min_micro_batch", &GuardOptions::min_micro_batch)
      .def_readwrite("max_micro_batch", &GuardOptions::max_micro_batch)
      .def_readwrite("grow_after", &GuardOptions::grow_after)
      .def_readwrite("grow_tolerance", &GuardOptions::grow_tolerance)
      .def_readwrite("forget_bad_after", &GuardOptions::forget_bad_after)
      // "predictive" (fit the device's memory figures) or "search" (halve,
      // then binary search): size_controller.h.
      .def_property(
          "controller", [](const GuardOptions& o) { return std::string(SizePolicyName(o.controller)); },
          [](GuardOptions& o, const std::string& name) {
            if (name == "predictive") {
              o.controller = SizePolicy::kPredictive;
            } else if (name == "search") {
              o.controller = SizePolicy::kSearch;
            } else {
              throw py::value_error("GuardOptions.controller: '" + name +
                                    "' is not a policy; use 'predictive' or 'search'");
            }
          })
      .def_readwrite("max_ooms_per_step", &GuardOptions::max_ooms_per_step)
      .def_readwrite("max_rollbacks_per_step", &GuardOptions::max_rollbacks_per_step)
      .def_readwrite("retry_after_release", &GuardOptions::retry_after_release)
      .def_readwrite("history_steps", &GuardOptions::history_steps)
      .def_readwrite("uniform_micro_batch", &GuardOptions::uniform_micro_batch)
      .def_readwrite("vote_deadline_ms", &GuardOptions::vote_deadline_ms)
      .def_readwrite("run_id", &GuardOptions::run_id)
      .def_readwrite("workload", &GuardOptions::workload);

  m.def("validate_guard_options", [](const GuardOptions& o) { ThrowIfError(ValidateGuardOptions(o)); });

  // The Python objects behind the raw pointers in GuardOptions are kept alive
  // by the Guard (keep_alive), as the C++ contract "must outlive the Guard" asks.
  py::class_<Guard>(m, "Guard")
      .def(py::init([](const GuardOptions& options, Coordinator* coordinator, KnowledgeBase* knowledge_base,
                       RecoveryStore* recovery, Device* device) {
             GuardOptions o = options;
             o.coordinator = coordinator;
             o.device = device;
             o.incidents = knowledge_base != nullptr ? knowledge_base->sink() : nullptr;
             o.priors = knowledge_base;  // learned starting size for options.workload
             o.recovery = recovery;
             return ValueOrThrow(Guard::Create(o));
           }),
           py::arg("options"), py::kw_only(), py::arg("coordinator") = nullptr,
           py::arg("knowledge_base") = nullptr, py::arg("recovery") = nullptr, py::arg("device") = nullptr,
           py::keep_alive<1, 3>(), py::keep_alive<1, 4>(), py::keep_alive<1, 5>(), py::keep_alive<1, 6>())
      .def(
          "step",
          [](Guard& guard, int64_t samples, const py::function& micro, const py::object& apply,
             const py::object& reset, std::optional<std::vector<int64_t>> costs,
             std::optional<std::vector<int64_t>> units, const py::object& sync) {
            // Made while the GIL is held; the request's std::functions only
            // copy these shared handles, never Python references.
            PyCallable micro_fn(micro), apply_fn(apply), reset_fn(reset), sync_fn(sync);
            PyCallable sync_objects;  // what sync() returned: alive until Step returns
            StepRequest req;
            req.samples = samples;
            if (costs) req.costs = std::span<const int64_t>(*costs);
            if (units) req.units = std::span<const int64_t>(*units);
            req.micro = [&micro_fn](const MicroBatch& mb) { CallGuarded(micro_fn, mb); };
            if (apply_fn) req.apply = [&apply_fn] { CallGuarded(apply_fn); };
            if (reset_fn) req.reset = [&reset_fn] { CallGuarded(reset_fn); };
            if (sync_fn) req.sync = [&sync_fn, &sync_objects] { return SumBuffers(sync_fn, &sync_objects); };
            return RunReported([&](StepReport* report) { return guard.Step(req, report); });
          },
          py::arg("samples"), py::arg("micro"), py::arg("apply") = py::none(), py::arg("reset") = py::none(),
          py::arg("costs") = py::none(), py::arg("units") = py::none(), py::arg("sync") = py::none())
      .def(
          "evaluate",
          [](Guard& guard, int64_t samples, const py::function& micro, std::optional<std::vector<int64_t>> costs,
             std::optional<std::vector<int64_t>> units) {
            PyCallable micro_fn(micro);
            EvalRequest req;
            req.samples = samples;
            if (costs) req.costs = std::span<const int64_t>(*costs);
            if (units) req.units = std::span<const int64_t>(*units);
            req.micro = [&micro_fn](const MicroBatch& mb) { CallGuarded(micro_fn, mb); };
            return RunReported([&](StepReport* report) { return guard.Evaluate(req, report); });
          },
          py::arg("samples"), py::arg("micro"), py::arg("costs") = py::none(), py::arg("units") = py::none(),
          "One batch of evaluation on this rank, split so that it fits (Guard::Evaluate); not collective.")
      .def("resume", [](Guard& guard) { return ValueOrThrow(WithoutGil([&] { return guard.Resume(); })); },
           "Collective: every rank restores the newest checkpoint that every rank holds and can load; "
           "returns its step (next_step is the one after). Raises CheckpointNotFoundError when none is common to every rank.")
      .def("finish", [](Guard& guard) { return ValueOrThrow(WithoutGil([&] { return guard.Finish(); })); },
           "Collective: waits for the checkpoint saves in flight and agrees with every rank on the newest "
           "checkpoint complete everywhere (rank 0 commits it); returns its step (-1: none).")
      .def(
          "mark_phase",
          [](Guard& g, Phase p) {
            // Fault rules fire here: their OOMs must reach the guard as Python
            // OOMs, not as RuntimeErrors it would pass through.
            try {
              g.MarkPhase(p);
            } catch (const DeviceOomError& e) {
              RaiseInjectedOom("device", e.what(), e.requested_bytes());
            } catch (const HostOomError& e) {
              RaiseInjectedOom("host", e.what(), e.requested_bytes());
            }
          },
          py::arg("phase"))
      .def(
          "add_cache_releaser",
          [](Guard& g, std::string name, const py::function& fn) {
            g.AddCacheReleaser(name, Releaser(PyCallable(fn), name));
          },
          py::arg("name"), py::arg("release"))
      .def_property("next_step", &Guard::step,
                    [](Guard& g, int64_t step) { ThrowIfError(g.SetStep(step)); })
      .def_property("micro_limit", &Guard::micro_limit, &Guard::SetMicroLimit)
      .def_property_readonly("eval_micro_limit", &Guard::eval_micro_limit)
      .def_property_readonly("total_ooms", &Guard::total_ooms)
      .def_property_readonly("run_id", &Guard::run_id)
      .def_property_readonly("options", [](const Guard& g) {
        GuardOptions o = g.options();
        return o;
      });

  // ---- OOM classification and fault injection ----
  m.def(
      "classify_message",
      [](std::string_view message) {
        OomInfo info = ClassifyMessage(message);
        return py::make_tuple(std::string(OomKindName(info.kind)), info.requested_bytes);
      },
      py::arg("message"), "(kind, requested_bytes) of an error message; kind 'none' when it is not an OOM.");
  m.def("set_fault_rules", [](std::string_view spec) { ThrowIfError(SetFaultRules(spec)); }, py::arg("spec"));
  m.def("clear_fault_rules", &ClearFaultRules);
  m.def("active_fault_rules", &ActiveFaultRules);
  m.def("faults_fired", &FaultsFired);
  m.attr("EXIT_COORDINATION_TIMEOUT") = kExitCoordinationTimeout;
}

}  // namespace oomguard::python
