// Bindings of checkpoint.h: the Checkpointer (a RecoveryStore the guard rolls
// back through) and the offline inspection functions.
//
// Tensors are registered by address, without a copy: the Python side passes
// the data pointer of a contiguous CPU tensor (or NumPy array) together with
// the object that owns the memory, which the Checkpointer keeps alive
// (keep_alive), so the address stays valid for the Checkpointer's life.
//
// GIL: save_async, wait, load_latest, load and restore release it; the save
// and load callbacks of objects take it back.

#include <pybind11/stl.h>

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "oomguard/checkpoint.h"
#include "oomguard/recovery.h"

namespace oomguard::python {
namespace {

DType DTypeFromName(const std::string& name) {
  auto d = ParseDType(name);
  if (!d) throw StatusError(Status::InvalidArgument("unknown dtype '" + name + "'"));
  return *d;
}

// Names from a file, as Python strs (Text: bytes that are not UTF-8 as \xNN).
py::list Texts(const std::vector<std::string>& v) {
  py::list out;
  for (const std::string& s : v) out.append(Text(s));
  return out;
}

MemoryLocation LocationFromName(const std::string& name) {
  if (name == "host" || name == "cpu") return MemoryLocation::kHost;
  if (name == "cuda") return MemoryLocation::kCuda;
  throw StatusError(Status::InvalidArgument("unknown memory location '" + name + "' (host or cuda)"));
}

}  // namespace

void BindCheckpoint(py::module_& m) {
  m.attr("CHECKPOINT_FORMAT") = std::string(kCheckpointFormat);
  m.attr("ZSTD_FILTER_ID") = kZstdFilterId;
  m.def("dtype_size", [](const std::string& name) { return DTypeSize(DTypeFromName(name)); });

  py::class_<CheckpointOptions>(m, "CheckpointOptions")
      .def(py::init<>())
      .def_readwrite("dir", &CheckpointOptions::dir)
      .def_readwrite("rank", &CheckpointOptions::rank)
      .def_readwrite("world_size", &CheckpointOptions::world_size)
      .def_readwrite("every_steps", &CheckpointOptions::every_steps)
      .def_readwrite("save_after_recovery", &CheckpointOptions::save_after_recovery)
      .def_readwrite("keep", &CheckpointOptions::keep)
      .def_property(
          "compression",
          [](const CheckpointOptions& o) {
            return o.compression == CheckpointCompression::kNone   ? "none"
                   : o.compression == CheckpointCompression::kZstd ? "zstd"
                                                                   : "auto";
          },
          [](CheckpointOptions& o, const std::string& v) {
            if (v == "auto")
              o.compression = CheckpointCompression::kAuto;
            else if (v == "none")
              o.compression = CheckpointCompression::kNone;
            else if (v == "zstd")
              o.compression = CheckpointCompression::kZstd;
            else
              throw py::value_error("compression: '" + v + "' (expected auto, none or zstd)");
          })
      .def_readwrite("compression_level", &CheckpointOptions::compression_level)
      .def_readwrite("chunk_bytes", &CheckpointOptions::chunk_bytes)
      .def_readwrite("threads", &CheckpointOptions::threads)
      .def_readwrite("stage_threads", &CheckpointOptions::stage_threads)
      .def_readwrite("staging_budget_bytes", &CheckpointOptions::staging_budget_bytes)
      .def_readwrite("keep_snapshot", &CheckpointOptions::keep_snapshot)
      .def_property(
          "manifest_commit",
          [](const CheckpointOptions& o) {
            return o.manifest_commit == ManifestCommit::kLocal         ? "local"
                   : o.manifest_commit == ManifestCommit::kCoordinated ? "coordinated"
                                                                        : "auto";
          },
          [](CheckpointOptions& o, const std::string& v) {
            if (v == "auto")
              o.manifest_commit = ManifestCommit::kAuto;
            else if (v == "local")
              o.manifest_commit = ManifestCommit::kLocal;
            else if (v == "coordinated")
              o.manifest_commit = ManifestCommit::kCoordinated;
            else
              throw py::value_error("manifest_commit: '" + v + "' (expected auto, local or coordinated)");
          })
      .def_readwrite("fsync", &CheckpointOptions::fsync)
      .def_readwrite("verify_file_checksum", &CheckpointOptions::verify_file_checksum)
      .def_property(
          "cuda_streams", [](const CheckpointOptions& o) { return static_cast<bool>(o.cuda_streams); },
          [](CheckpointOptions& o, const py::object& fn) {
            // A Python callable returning the cudaStream_t values (ints) that the
            // staging and restore copies of CUDA tensors must wait for.
            if (fn.is_none()) {
              o.cuda_streams = nullptr;
              return;
            }
            PyCallable call(fn);
            o.cuda_streams = [call]() {
              py::gil_scoped_acquire gil;
              std::vector<void*> out;
              try {
                for (py::handle h : call.get()())
                  out.push_back(reinterpret_cast<void*>(h.cast<uintptr_t>()));
              } catch (py::error_already_set& e) {
                // Ordering after the default stream is the safe fallback.
                e.discard_as_unraisable("oomguard Checkpointer cuda_streams");
              }
              return out;
            };
          },
          "Callable returning the CUDA streams (cudaStream_t ints) whose work checkpoint copies wait for.");

  py::class_<CheckpointStats>(m, "CheckpointStats")
      .def_readonly("saves_started", &CheckpointStats::saves_started)
      .def_readonly("checkpoints_written", &CheckpointStats::checkpoints_written)
      .def_readonly("manifests_committed", &CheckpointStats::manifests_committed)
      .def_readonly("save_failures", &CheckpointStats::save_failures)
      .def_readonly("restores_from_memory", &CheckpointStats::restores_from_memory)
      .def_readonly("restores_from_disk", &CheckpointStats::restores_from_disk)
      .def_readonly("corrupt_skipped", &CheckpointStats::corrupt_skipped)
      .def_readonly("state_bytes", &CheckpointStats::state_bytes)
      .def_readonly("last_file_bytes", &CheckpointStats::last_file_bytes)
      .def_readonly("stall_ms", &CheckpointStats::stall_ms)
      .def_readonly("stall_allocations", &CheckpointStats::stall_allocations)
      .def_readonly("last_write_ms", &CheckpointStats::last_write_ms)
      .def_readonly("last_compression", &CheckpointStats::last_compression)
      .def_readonly("last_compression_auto", &CheckpointStats::last_compression_auto)
      .def_readonly("last_error", &CheckpointStats::last_error);

  py::class_<RecoveryStore>(m, "RecoveryStore")
      .def("durable_steps", [](RecoveryStore& r) { return WithoutGil([&] { return r.DurableSteps(); }); })
      .def("snapshot_step", [](RecoveryStore& r) { return WithoutGil([&] { return r.SnapshotStep(); }); })
      .def(
          "snapshot", [](RecoveryStore& r, int64_t step) { ThrowIfError(WithoutGil([&] { return r.Snapshot(step); })); },
          py::arg("step"))
      .def(
          "restore", [](RecoveryStore& r, int64_t step) { ThrowIfError(WithoutGil([&] { return r.Restore(step); })); },
          py::arg("step"));

  py::class_<Checkpointer, RecoveryStore>(m, "Checkpointer")
      .def(py::init([](const CheckpointOptions& o) { return ValueOrThrow(Checkpointer::Create(o)); }),
           py::arg("options"))
      .def(
          "add_tensor",
          [](Checkpointer& c, std::string path, const std::string& dtype, std::vector<int64_t> shape,
             uintptr_t data_ptr, const py::object& owner, const std::string& location) {
            (void)owner;  // kept alive by keep_alive<1, 6>
            ThrowIfError(c.AddTensor(std::move(path), DTypeFromName(dtype), std::move(shape),
                                     reinterpret_cast<void*>(data_ptr), LocationFromName(location)));
          },
          py::arg("path"), py::arg("dtype"), py::arg("shape"), py::arg("data_ptr"), py::arg("owner"),
          py::arg("location") = "host", py::keep_alive<1, 6>(),
          "Registers the memory at data_ptr (row-major, prod(shape) elements) by address; `owner` "
          "(the tensor or array) is kept alive as long as the Checkpointer.")
      .def(
          "add_object",
          [](Checkpointer& c, std::string path, const py::function& save, const py::function& load) {
            PyCallable save_fn(save), load_fn(load);
            auto save_bytes = [save_fn]() -> std::vector<uint8_t> {
              py::gil_scoped_acquire gil;  // the bytes object is released before the GIL
              try {
                py::bytes b = CallGuarded<py::bytes>(save_fn);
                const std::string_view v = b;
                return std::vector<uint8_t>(v.begin(), v.end());
              } catch (PythonPassthrough& p) {
                // An Exception costs this checkpoint: the SDK counts and
                // reports it with its type and message, and training goes
                // on. A KeyboardInterrupt (any other BaseException) passes
                // on through the save and the guard's step.
                if (Survivable(p.error)) throw std::runtime_error(p.type + ": " + p.message);
                throw;
              }
            };
            auto load_bytes = [load_fn](std::span<const uint8_t> data) -> Status {
              // Python errors pass through unchanged: a failing load is the
              // user's bug, not a corrupt checkpoint to be skipped.
              py::gil_scoped_acquire gil;
              py::bytes b(reinterpret_cast<const char*>(data.data()), data.size());
              CallGuarded(load_fn, std::move(b));
              return Status::Ok();
            };
            ThrowIfError(c.AddObject(std::move(path), save_bytes, load_bytes));
          },
          py::arg("path"), py::arg("save"), py::arg("load"),
          "Registers a stateful object: save() -> bytes runs while a save is staged, load(bytes) on restore.")
      .def(
          "save_async", [](Checkpointer& c, int64_t step) { ThrowIfError(WithoutGil([&] { return c.SaveAsync(step); })); },
          py::arg("step"))
      .def("wait", [](Checkpointer& c) { ThrowIfError(WithoutGil([&] { return c.Wait(); })); })
      .def("load_latest", [](Checkpointer& c) { return ValueOrThrow(WithoutGil([&] { return c.LoadLatest(); })); })
      .def(
          "load", [](Checkpointer& c, int64_t step) { return ValueOrThrow(WithoutGil([&] { return c.Load(step); })); },
          py::arg("step"))
      .def(
          "commit",
          [](Checkpointer& c, int64_t step, int world_size) {
            ThrowIfError(WithoutGil([&] { return c.Commit(step, world_size); }));
          },
          py::arg("step"), py::arg("world_size"),
          "Coordinated commit (rank 0): writes the manifest of `step` once every rank's shard is durable.")
      .def_property_readonly("stats", &Checkpointer::Stats)
      .def_property_readonly("options", [](const Checkpointer& c) { return c.options(); });

  py::class_<TensorInfo>(m, "TensorInfo")
      .def_property_readonly("path", [](const TensorInfo& t) { return Text(t.path); })
      .def_property_readonly("dtype", [](const TensorInfo& t) { return Text(t.dtype); })
      .def_readonly("shape", &TensorInfo::shape)
      .def_readonly("chunk", &TensorInfo::chunk)
      .def_readonly("bytes", &TensorInfo::bytes)
      .def_readonly("stored_bytes", &TensorInfo::stored_bytes)
      .def_property_readonly("xxh3", [](const TensorInfo& t) { return Text(t.xxh3); })
      .def_property_readonly("filters", [](const TensorInfo& t) { return Texts(t.filters); });
  py::class_<ShardInfo>(m, "ShardInfo")
      .def_property_readonly("file", [](const ShardInfo& i) { return Text(i.file); })
      .def_property_readonly("format", [](const ShardInfo& i) { return Text(i.format); })
      .def_readonly("step", &ShardInfo::step)
      .def_readonly("rank", &ShardInfo::rank)
      .def_readonly("world_size", &ShardInfo::world_size)
      .def_readonly("file_bytes", &ShardInfo::file_bytes)
      .def_readonly("tensors", &ShardInfo::tensors);
  py::class_<CheckpointInfo>(m, "CheckpointInfo")
      .def_readonly("step", &CheckpointInfo::step)
      .def_property_readonly("dir", [](const CheckpointInfo& i) { return Text(i.dir); })
      .def_readonly("committed", &CheckpointInfo::committed)
      .def_readonly("world_size", &CheckpointInfo::world_size)
      .def_readonly("created_unix", &CheckpointInfo::created_unix)
      .def_readonly("bytes", &CheckpointInfo::bytes)
      .def_property_readonly("shards", [](const CheckpointInfo& i) { return Texts(i.shards); })
      .def_property_readonly("problem", [](const CheckpointInfo& i) { return Text(i.problem); });

  m.def("list_checkpoints", [](const std::string& dir) { return ValueOrThrow(ListCheckpoints(dir)); },
        py::arg("dir"));
  m.def(
      "verify_checkpoint",
      [](const std::string& dir, int64_t step, int expected_world_size) {
        ThrowIfError(WithoutGil([&] { return VerifyCheckpoint(dir, step, expected_world_size); }));
      },
      py::arg("dir"), py::arg("step"), py::arg("expected_world_size") = -1);
  m.def("inspect_shard", [](const std::string& file) { return ValueOrThrow(InspectShard(file)); },
        py::arg("file"));
}

}  // namespace oomguard::python
