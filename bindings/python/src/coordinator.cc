// Bindings of coordinator.h, with a trampoline so that a Python object can be
// the guard's coordinator (oomguard.torch.TorchDistributedCoordinator is one).
//
// A Python coordinator implements, with deadlines in seconds (float):
//   rank() -> int, size() -> int, engine() -> str
//   vote(vote_input, deadline_s) -> VoteResult   (pack_vote/unpack_vote: one
//                                                 allreduce of VOTE_WORDS int64 with MAX)
//   gather_memory(mine, deadline_s) -> list[RankMemory]
//   barrier(deadline_s) -> None
//   broadcast(data: bytes, root, deadline_s) -> bytes
//   allreduce_sum(array: numpy float64, deadline_s) -> None   (in place)
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

class PyCoordinator : public Coordinator {
 public:
  using Coordinator::Coordinator;

  int rank() const override { PYBIND11_OVERRIDE_PURE(int, Coordinator, rank, ); }
  int size() const override { PYBIND11_OVERRIDE_PURE(int, Coordinator, size, ); }
  std::string engine() const override { PYBIND11_OVERRIDE_PURE(std::string, Coordinator, engine, ); }

  StatusOr<VoteResult> Vote(const VoteInput& in, std::chrono::milliseconds deadline) override {
    return Call<VoteResult>("vote", [&](py::function& f) { return f(in, Seconds(deadline)).cast<VoteResult>(); });
  }

  StatusOr<std::vector<RankMemory>> GatherMemory(const RankMemory& mine, std::chrono::milliseconds deadline) override {
    return Call<std::vector<RankMemory>>("gather_memory", [&](py::function& f) {
      return f(mine, Seconds(deadline)).cast<std::vector<RankMemory>>();
    });
  }

  Status Barrier(std::chrono::milliseconds deadline) override {
    return Call<bool>("barrier", [&](py::function& f) {
             f(Seconds(deadline));
             return true;
           }).status();
  }

  Status Broadcast(std::vector<uint8_t>* data, int root, std::chrono::milliseconds deadline) override {
    auto r = Call<bool>("broadcast", [&](py::function& f) {
      py::bytes in(reinterpret_cast<const char*>(data->data()), data->size());
      py::bytes out = f(in, root, Seconds(deadline));
      const std::string_view v = out;
      data->assign(v.begin(), v.end());
      return true;
    });
    return r.status();
  }

  Status AllreduceSum(std::span<double> data, std::chrono::milliseconds deadline) override {
    return Call<bool>("allreduce_sum", [&](py::function& f) {
             // A view of the caller's buffer (no copy), valid during the call.
             py::capsule no_owner(data.data(), [](void*) {});
             py::array_t<double> view({static_cast<py::ssize_t>(data.size())}, {sizeof(double)}, data.data(),
                                      no_owner);
             f(view, Seconds(deadline));
             return true;
           }).status();
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
  template <typename T, typename F>
  StatusOr<T> Call(const char* method, F&& body) {
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
  m.attr("VOTE_WORDS") = kVoteWords;

  py::enum_<VoteStatus>(m, "VoteStatus")
      .value("ok", VoteStatus::kOk)
      .value("rollback", VoteStatus::kRollback)
      .value("failed", VoteStatus::kFailed);

  py::class_<VoteInput>(m, "VoteInput")
      .def(py::init<>())
      .def_readwrite("status", &VoteInput::status)
      .def_readwrite("durable_step", &VoteInput::durable_step)
      .def_readwrite("snapshot_step", &VoteInput::snapshot_step)
      .def_readwrite("micro_limit", &VoteInput::micro_limit)
      .def_readwrite("had_oom", &VoteInput::had_oom);

  py::class_<VoteResult>(m, "VoteResult")
      .def(py::init<>())
      .def_readwrite("status", &VoteResult::status)
      .def_readwrite("min_durable_step", &VoteResult::min_durable_step)
      .def_readwrite("min_snapshot_step", &VoteResult::min_snapshot_step)
      .def_readwrite("max_snapshot_step", &VoteResult::max_snapshot_step)
      .def_readwrite("min_micro_limit", &VoteResult::min_micro_limit)
      .def_readwrite("any_oom", &VoteResult::any_oom);

  m.def(
      "pack_vote",
      [](const VoteInput& in) {
        int64_t words[kVoteWords];
        PackVote(in, words);
        return std::vector<int64_t>(words, words + kVoteWords);
      },
      py::arg("vote_input"), "The vote as VOTE_WORDS int64 to be reduced with MAX over ranks.");
  m.def(
      "unpack_vote",
      [](const std::vector<int64_t>& reduced) {
        if (reduced.size() != static_cast<size_t>(kVoteWords))
          throw StatusError(Status::InvalidArgument("unpack_vote needs " + std::to_string(kVoteWords) +
                                                    " words (got " + std::to_string(reduced.size()) + ")"));
        return UnpackVote(reduced.data());
      },
      py::arg("reduced_max"));

  py::class_<Coordinator, PyCoordinator, std::unique_ptr<Coordinator>>(m, "Coordinator")
      .def(py::init<>())
      .def("rank", &Coordinator::rank)
      .def("size", &Coordinator::size)
      .def("engine", &Coordinator::engine)
      .def(
          "vote",
          [](Coordinator& c, const VoteInput& in, double deadline_s) {
            return ValueOrThrow(WithoutGil([&] {
              return c.Vote(in, std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000)));
            }));
          },
          py::arg("vote_input"), py::arg("deadline_s"))
      .def(
          "barrier",
          [](Coordinator& c, double deadline_s) {
            ThrowIfError(WithoutGil(
                [&] { return c.Barrier(std::chrono::milliseconds(static_cast<int64_t>(deadline_s * 1000))); }));
          },
          py::arg("deadline_s"))
      .def("abort", [](Coordinator& c) { WithoutGil([&] { c.Abort(); }); });

  m.def("make_local_coordinator", &MakeLocalCoordinator);
  m.def(
      "make_thread_group", [](int size) { return ValueOrThrow(MakeThreadGroup(size)); }, py::arg("size"),
      "`size` coordinators sharing one group (ranks as threads of this process), one per thread.");
}

}  // namespace oomguard::python
