// JSON exchange format of Incident, and the stored form of SizeModel. Parsing
// is defensive: the input may come from other tools or be hostile, so every
// field is type-checked and bounded, and nothing throws past this file.
#include <xxhash.h>

#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/store.h"

namespace oomguard {
namespace {

using nlohmann::json;

constexpr size_t kMaxString = 64 * 1024;
constexpr size_t kMaxArray = 4096;

json MemoryToJson(const MemoryStats& m) {
  return json{{"total", m.total},
              {"free", m.free},
              {"allocated", m.allocated},
              {"reserved", m.reserved},
              {"peak_allocated", m.peak_allocated},
              {"active", m.active},
              {"inactive_split", m.inactive_split},
              {"num_alloc_retries", m.num_alloc_retries},
              {"num_ooms", m.num_ooms}};
}

// Unknown grad recording is null, as a reader of the JSON expects.
json FrameworkToJson(const FrameworkEvidence& f) {
  return json{{"grad_recording", f.grad_recording ? json(*f.grad_recording) : json(nullptr)},
              {"state_copy_bytes", f.state_copy_bytes}};
}

// "data, forward, ...": every name of an incident enum. Their enumerators
// are dense from 0, and a name function maps an out-of-range value to the
// first enumerator's name, which ends the walk.
template <typename E>
std::string Vocabulary(std::string_view (*name)(E)) {
  std::string out(name(static_cast<E>(0)));
  for (int i = 1; i < 64 && name(static_cast<E>(i)) != name(static_cast<E>(0)); ++i)
    out += ", " + std::string(name(static_cast<E>(i)));
  return out;
}

// Reads fields of one JSON object into typed destinations; the first error wins
// and names the field by its dotted path.
class FieldReader {
 public:
  FieldReader(const json& obj, std::string prefix, Status* error)
      : obj_(obj), prefix_(std::move(prefix)), error_(error) {}

  void Int(const char* key, int64_t* out) {
    const json* v = Find(key);
    if (v == nullptr) return;
    if (v->is_number_integer()) {
      if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
        Fail(key, "is out of range");
        return;
      }
      *out = v->get<int64_t>();
    } else if (v->is_number_float()) {
      double d = v->get<double>();
      // Other tools write byte counts as floats (1.5e9); accept whole numbers in range.
      if (!std::isfinite(d) || d != std::floor(d) || std::fabs(d) > 9.0e18) {
        Fail(key, "must be an integer");
        return;
      }
      *out = static_cast<int64_t>(d);
    } else {
      Fail(key, std::string("must be an integer, got ") + v->type_name());
    }
  }
  void Int(const char* key, int* out) {
    int64_t v = *out;
    Int(key, &v);
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max()) {
      Fail(key, "is out of range");
      return;
    }
    *out = static_cast<int>(v);
  }
  void Double(const char* key, double* out) {
    const json* v = Find(key);
    if (v == nullptr) return;
    if (!v->is_number()) {
      Fail(key, std::string("must be a number, got ") + v->type_name());
      return;
    }
    double d = v->get<double>();
    if (!std::isfinite(d)) {
      Fail(key, "must be finite");
      return;
    }
    *out = d;
  }
  void String(const char* key, std::string* out) {
    const json* v = Find(key);
    if (v == nullptr) return;
    if (!v->is_string()) {
      Fail(key, std::string("must be a string, got ") + v->type_name());
      return;
    }
    const auto& s = v->get_ref<const std::string&>();
    if (s.size() > kMaxString) {
      Fail(key, "is longer than " + std::to_string(kMaxString) + " bytes (" + std::to_string(s.size()) + ")");
      return;
    }
    *out = s;
  }
  void Bool(const char* key, bool* out) {
    const json* v = Find(key);
    if (v == nullptr) return;
    if (!v->is_boolean()) {
      Fail(key, std::string("must be true or false, got ") + v->type_name());
      return;
    }
    *out = v->get<bool>();
  }
  // Returns the array at key (nullptr when absent/null or on error).
  const json* Array(const char* key) {
    const json* v = Find(key);
    if (v == nullptr) return nullptr;
    if (!v->is_array()) {
      Fail(key, std::string("must be an array, got ") + v->type_name());
      return nullptr;
    }
    if (v->size() > kMaxArray) {
      Fail(key, "has more than " + std::to_string(kMaxArray) + " entries (" + std::to_string(v->size()) + ")");
      return nullptr;
    }
    return v;
  }
  const json* Object(const char* key) {
    const json* v = Find(key);
    if (v == nullptr) return nullptr;
    if (!v->is_object()) {
      Fail(key, std::string("must be an object, got ") + v->type_name());
      return nullptr;
    }
    return v;
  }
  void StringArray(const char* key, std::vector<std::string>* out) {
    const json* a = Array(key);
    if (a == nullptr) return;
    out->clear();
    for (size_t i = 0; i < a->size(); ++i) {
      const json& e = (*a)[i];
      if (!e.is_string() || e.get_ref<const std::string&>().size() > kMaxString) {
        Fail(key, "[" + std::to_string(i) + "] must be a string of at most 64 KiB");
        return;
      }
      out->push_back(e.get<std::string>());
    }
  }
  // A value of a fixed vocabulary (incident.h). Absent or "": the field keeps
  // its default (unknown); any other string outside the vocabulary is an
  // error that lists it. `name` and `parse` are the enum's name functions.
  template <typename E>
  void Enum(const char* key, std::string_view (*name)(E), std::optional<E> (*parse)(std::string_view), E* out) {
    std::string s;
    String(key, &s);
    if (!error_->ok() || s.empty()) return;
    if (std::optional<E> e = parse(s)) {
      *out = *e;
      return;
    }
    Fail(key, "is '" + s.substr(0, 64) + "', not one of " + Vocabulary(name));
  }
  template <typename E>
  void EnumArray(const char* key, std::string_view (*name)(E), std::optional<E> (*parse)(std::string_view),
                 std::vector<E>* out) {
    std::vector<std::string> names;
    StringArray(key, &names);
    if (!error_->ok()) return;
    out->clear();
    for (size_t i = 0; i < names.size(); ++i) {
      std::optional<E> e = parse(names[i]);
      if (!e) {
        const std::string element = std::string(key) + "[" + std::to_string(i) + "]";
        Fail(element.c_str(), "is '" + names[i].substr(0, 64) + "', not one of " + Vocabulary(name));
        return;
      }
      out->push_back(*e);
    }
  }
  std::string Path(const char* key) const { return prefix_ + key; }
  bool Present(const char* key) const {
    auto it = obj_.find(key);
    return it != obj_.end() && !it->is_null();
  }

 private:
  const json* Find(const char* key) {
    if (!error_->ok()) return nullptr;
    auto it = obj_.find(key);
    if (it == obj_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  void Fail(const char* key, const std::string& what) {
    if (error_->ok()) *error_ = Status::InvalidArgument("field '" + prefix_ + key + "' " + what);
  }

  const json& obj_;
  std::string prefix_;
  Status* error_;
};

void ReadMemory(const json& m, MemoryStats* out, Status* err) {
  FieldReader r(m, "memory.", err);
  r.Int("total", &out->total);
  r.Int("free", &out->free);
  r.Int("allocated", &out->allocated);
  r.Int("reserved", &out->reserved);
  r.Int("peak_allocated", &out->peak_allocated);
  r.Int("active", &out->active);
  r.Int("inactive_split", &out->inactive_split);
  r.Int("num_alloc_retries", &out->num_alloc_retries);
  r.Int("num_ooms", &out->num_ooms);
  // torch.cuda.memory_stats spellings, as other tools export them.
  r.Int("allocated_bytes.all.current", &out->allocated);
  r.Int("reserved_bytes.all.current", &out->reserved);
  r.Int("allocated_bytes.all.peak", &out->peak_allocated);
  r.Int("inactive_split_bytes.all.current", &out->inactive_split);
}

std::string Hex16(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, h);
  return buf;
}

}  // namespace

namespace kb {

std::optional<Phase> ParseStoredPhase(std::string_view name) {
  if (name == "vote") return Phase::kComm;
  return ParsePhase(name);
}


std::string SizeModelToJson(const SizeModel& m) {
  return nlohmann::json{{"fixed_bytes", m.fixed_bytes},
                        {"unit_bytes", m.unit_bytes},
                        {"overhead_bytes", m.overhead_bytes},
                        {"overhead", m.overhead},
                        {"overhead_too_small", m.overhead_too_small},
                        {"noise_bytes", m.noise_bytes}}
      .dump();
}

std::optional<SizeModel> SizeModelFromJson(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  SizeModel m;
  auto field = [&](const char* key, double* out) {
    auto it = j.find(key);
    if (it == j.end()) return true;  // fields added later default to 0
    if (!it->is_number()) return false;
    *out = it->get<double>();
    return std::isfinite(*out) && *out >= 0;
  };
  if (!field("fixed_bytes", &m.fixed_bytes) || !field("unit_bytes", &m.unit_bytes) ||
      !field("overhead_bytes", &m.overhead_bytes) || !field("overhead", &m.overhead) ||
      !field("overhead_too_small", &m.overhead_too_small) || !field("noise_bytes", &m.noise_bytes) ||
      !(m.unit_bytes > 0)) {
    return std::nullopt;
  }
  return m;
}

}  // namespace kb

std::string IncidentToJson(const Incident& inc) {
  json ranks = json::array();
  for (const auto& r : inc.ranks) {
    ranks.push_back(
        {{"rank", r.rank}, {"allocated", r.allocated}, {"reserved", r.reserved}, {"peak_allocated", r.peak_allocated}});
  }
  json actions = json::array();
  for (LadderAction a : inc.actions) actions.push_back(LadderActionName(a));
  json j = {{"id", inc.id},
            {"run_id", inc.run_id},
            {"time_unix_ms", inc.time_unix_ms},
            {"host", inc.host},
            {"rank", inc.rank},
            {"world_size", inc.world_size},
            {"step", inc.step},
            {"micro_index", inc.micro_index},
            {"phase", PhaseName(inc.phase)},
            {"kind", IncidentKindName(inc.kind)},
            {"exception_type", inc.exception_type},
            {"message", inc.message},
            {"requested_bytes", inc.requested_bytes},
            {"memory", MemoryToJson(inc.memory)},
            {"history", {{"step_peaks", inc.step_peaks}, {"steps_ok_before", inc.steps_ok_before}}},
            {"sample_cost", {{"this", inc.sample_cost_this}, {"median", inc.sample_cost_median}}},
            {"ranks", ranks},
            {"micro_before", inc.micro_before},
            {"micro_after", inc.micro_after},
            {"action", LadderActionName(inc.action)},
            {"actions", actions},
            {"outcome", IncidentOutcomeName(inc.outcome)},
            {"recovery_ms", inc.recovery_ms},
            {"workload", inc.workload},
            {"injected", inc.injected},
            {"framework", FrameworkToJson(inc.framework)},
            {"source", inc.source},
            {"context", inc.context},
            {"unknown", inc.unknown},
            {"pattern", inc.pattern},
            {"confidence", inc.confidence},
            {"evidence", inc.evidence},
            {"remedies", inc.remedies},
            {"fingerprint", inc.fingerprint}};
  // Invalid UTF-8 (a raw exception message) is replaced rather than thrown on.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

StatusOr<Incident> IncidentFromJson(std::string_view text) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return Status::InvalidArgument(std::string("not valid JSON: ") + e.what());
  } catch (const std::exception& e) {
    return Status::InvalidArgument(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) return Status::InvalidArgument(std::string("expected a JSON object, got ") + j.type_name());

  Incident inc;
  Status err;
  try {
    FieldReader r(j, "", &err);
    r.String("id", &inc.id);
    r.String("run_id", &inc.run_id);
    r.Int("time_unix_ms", &inc.time_unix_ms);
    r.String("host", &inc.host);
    r.Int("rank", &inc.rank);
    r.Int("world_size", &inc.world_size);
    r.Int("step", &inc.step);
    bool history_known = false;
    r.Int("micro_index", &inc.micro_index);
    r.Enum("phase", PhaseName, kb::ParseStoredPhase, &inc.phase);
    r.Enum("kind", IncidentKindName, ParseIncidentKind, &inc.kind);
    r.String("exception_type", &inc.exception_type);
    r.String("message", &inc.message);
    r.Int("requested_bytes", &inc.requested_bytes);
    if (const json* m = r.Object("memory")) ReadMemory(*m, &inc.memory, &err);
    if (const json* h = r.Object("history")) {
      FieldReader hr(*h, "history.", &err);
      if (const json* peaks = hr.Array("step_peaks")) {
        for (size_t i = 0; i < peaks->size() && err.ok(); ++i) {
          const json& p = (*peaks)[i];
          if (!p.is_number() || !std::isfinite(p.get<double>())) {
            err = Status::InvalidArgument("field 'history.step_peaks[" + std::to_string(i) + "]' must be a number");
            break;
          }
          inc.step_peaks.push_back(static_cast<int64_t>(p.get<double>()));
        }
      }
      hr.Int("steps_ok_before", &inc.steps_ok_before);
      history_known = hr.Present("steps_ok_before");
    }
    // Other tools often flatten the history; take theirs when ours is absent.
    if (!history_known && r.Present("steps_ok_before")) {
      r.Int("steps_ok_before", &inc.steps_ok_before);
      history_known = true;
    }
    if (const json* sc = r.Object("sample_cost")) {
      FieldReader sr(*sc, "sample_cost.", &err);
      sr.Double("this", &inc.sample_cost_this);
      sr.Double("median", &inc.sample_cost_median);
    }
    if (const json* ranks = r.Array("ranks")) {
      for (size_t i = 0; i < ranks->size() && err.ok(); ++i) {
        const json& e = (*ranks)[i];
        std::string prefix = "ranks[" + std::to_string(i) + "].";
        if (!e.is_object()) {
          err = Status::InvalidArgument("field '" + prefix.substr(0, prefix.size() - 1) + "' must be an object");
          break;
        }
        RankMemory rm;
        FieldReader rr(e, prefix, &err);
        rr.Int("rank", &rm.rank);
        rr.Int("allocated", &rm.allocated);
        rr.Int("reserved", &rm.reserved);
        rr.Int("peak_allocated", &rm.peak_allocated);
        inc.ranks.push_back(rm);
      }
    }
    r.Int("micro_before", &inc.micro_before);
    r.Int("micro_after", &inc.micro_after);
    r.Enum("action", LadderActionName, ParseLadderAction, &inc.action);
    r.EnumArray("actions", LadderActionName, ParseLadderAction, &inc.actions);
    r.Enum("outcome", IncidentOutcomeName, ParseIncidentOutcome, &inc.outcome);
    r.Double("recovery_ms", &inc.recovery_ms);
    r.String("workload", &inc.workload);
    r.Bool("injected", &inc.injected);
    if (const json* fw = r.Object("framework")) {
      FieldReader fr(*fw, "framework.", &err);
      if (fr.Present("grad_recording")) {
        bool recording = false;
        fr.Bool("grad_recording", &recording);
        inc.framework.grad_recording = recording;
      }
      fr.Int("state_copy_bytes", &inc.framework.state_copy_bytes);
    }
    r.String("pattern", &inc.pattern);
    r.Double("confidence", &inc.confidence);
    r.String("evidence", &inc.evidence);
    r.StringArray("remedies", &inc.remedies);
    r.String("fingerprint", &inc.fingerprint);
    r.String("source", &inc.source);
    r.String("context", &inc.context);
    if (r.Present("unknown")) {
      r.StringArray("unknown", &inc.unknown);
    } else {
      // A record from another tool: what it does not carry is unknown, not 0.
      if (!r.Present("step")) inc.unknown.push_back("step");
      if (!history_known) inc.unknown.push_back("steps_ok_before");
      if (!r.Present("rank")) inc.unknown.push_back("rank");
    }
  } catch (const std::exception& e) {
    return Status::InvalidArgument(std::string("bad incident: ") + e.what());
  }
  if (!err.ok()) return err;
  if (inc.id.empty()) inc.id = Hex16(XXH3_64bits(text.data(), text.size()));
  if (inc.world_size < 1) inc.world_size = 1;
  if (inc.confidence < 0 || inc.confidence > 1) return Status::InvalidArgument("field 'confidence' must be in [0, 1]");
  return inc;
}

}  // namespace oomguard
