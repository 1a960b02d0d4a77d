// Bindings of knowledge_base.h: open the incident store, give it to a Guard
// (Guard(knowledge_base=kb) uses kb.sink()), read priors and incidents.
//
// Thread-safety: as the C++ class, every method may be called from any
// thread; the ones that touch the file release the GIL.

#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "oomguard/knowledge_base.h"

namespace oomguard::python {

void BindKnowledgeBase(py::module_& m) {
  py::class_<SinkStats>(m, "SinkStats")
      .def_readonly("enqueued", &SinkStats::enqueued)
      .def_readonly("dropped", &SinkStats::dropped)
      .def_readonly("written", &SinkStats::written)
      .def_readonly("write_errors", &SinkStats::write_errors)
      .def_readonly("spooled", &SinkStats::spooled)
      .def_readonly("spool_pending", &SinkStats::spool_pending)
      .def_readonly("last_error", &SinkStats::last_error)
      .def_property_readonly("lost", &SinkStats::lost);

  py::class_<KnowledgeBase>(m, "KnowledgeBase")
      .def(py::init([](std::optional<std::string> path, bool create_if_missing, bool read_only,
                       std::string spool_dir) {
             if (!path) {
               const char* url = std::getenv("OOMGUARD_KB_URL");
               if (url == nullptr || *url == '\0')
                 throw py::value_error("KnowledgeBase: give a path (an SQLite file or a postgresql:// URL) or set "
                                       "OOMGUARD_KB_URL");
               path = url;
             }
             KnowledgeBaseOptions o;
             o.create_if_missing = create_if_missing;
             o.read_only = read_only;
             o.spool_dir = std::move(spool_dir);
             return ValueOrThrow(WithoutGil([&] { return KnowledgeBase::Open(*path, o); }));
           }),
           py::arg("path") = py::none(), py::arg("create_if_missing") = true, py::arg("read_only") = false,
           py::arg("spool_dir") = "",
           "An SQLite file, or a postgresql:// URL (a team's server; incidents wait in spool_dir while it is "
           "away). No path: $OOMGUARD_KB_URL.")
      .def_property_readonly("path", &KnowledgeBase::path)
      .def("flush", [](KnowledgeBase& kb) { ThrowIfError(WithoutGil([&] { return kb.Flush(); })); })
      .def(
          "prior_micro_batch",
          [](KnowledgeBase& kb, const std::string& workload) {
            return WithoutGil([&] { return kb.PriorMicroBatch(workload); });
          },
          py::arg("workload"))
      .def(
          "record_clean_micro_batch",
          [](KnowledgeBase& kb, const std::string& workload, int64_t size) {
            ThrowIfError(kb.RecordCleanMicroBatch(workload, size));
          },
          py::arg("workload"), py::arg("size"))
      .def_property_readonly("sink_stats", &KnowledgeBase::sink_stats)
      .def(
          "query",
          [](KnowledgeBase& kb, std::string pattern, std::optional<int> rank, std::string run_id,
             std::string workload, int64_t limit) {
            IncidentQuery q;
            q.pattern = std::move(pattern);
            q.rank = rank;
            q.run_id = std::move(run_id);
            q.workload = std::move(workload);
            q.limit = limit;
            return ValueOrThrow(WithoutGil([&] { return kb.Query(q); }));
          },
          py::kw_only(), py::arg("pattern") = "", py::arg("rank") = py::none(), py::arg("run_id") = "",
          py::arg("workload") = "", py::arg("limit") = 0, "Incidents, newest first.")
      .def(
          "set_note",
          [](KnowledgeBase& kb, const std::string& fingerprint, const std::string& text, const std::string& author) {
            ThrowIfError(WithoutGil([&] { return kb.SetNote({fingerprint, text, author, 0}); }));
          },
          py::arg("fingerprint"), py::arg("text"), py::arg("author") = "",
          "Sets the team's note of a fingerprint group (empty text removes it).")
      .def(
          "notes",
          [](KnowledgeBase& kb) {
            auto notes = ValueOrThrow(WithoutGil([&] { return kb.Notes(); }));
            py::dict out;
            for (const GroupNote& n : notes) {
              py::dict d;
              d["text"] = n.text;
              d["author"] = n.author;
              d["updated_unix_ms"] = n.updated_unix_ms;
              out[py::str(n.fingerprint)] = d;
            }
            return out;
          },
          "Every group's note: {fingerprint: {text, author, updated_unix_ms}}.");
}

}  // namespace oomguard::python
