// Diagnosis on real OOM reports: how often the classifier names the pattern a
// careful reader assigns (tests/kb/testdata/reports), where it goes wrong (a
// confusion table, label x answer), how confident its wrong answers are, and
// what a diagnosis costs. Also parses the raw logs of tests/kb/testdata/logs
// the way `oomguard diagnose` does and counts their OOM events.
//
// Usage: diagnosis_bench [--json=PATH] [--reps=N]
// Prints a summary; --json writes every figure for bench/append_sections.py.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "sdk/kb/classifier_facts.h"
#include "tests/kb/dev_set.h"

namespace {

using oomguard::devset::Case;
using oomguard::devset::Verdict;

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

double NowUs() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct LogResult {
  std::string file;
  size_t bytes = 0;
  std::vector<std::string> patterns;  // one per OOM event, in log order
  double us = 0;                      // parse + classify, mean over reps
  std::string error;
};

LogResult RunLog(const std::filesystem::path& p, int reps) {
  LogResult r;
  r.file = p.filename().string();
  std::ifstream in(p, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  r.bytes = text.size();
  oomguard::kb::LogParseOptions o;
  o.source_name = r.file;
  const double t0 = NowUs();
  for (int k = 0; k < reps; ++k) {
    auto incs = oomguard::kb::ParseOomLog(text, o);
    if (!incs.ok()) {
      r.error = incs.status().ToString();
      return r;
    }
    r.patterns.clear();
    for (auto& inc : *incs) {
      oomguard::ClassifyInPlace(&inc);
      r.patterns.push_back(inc.pattern);
    }
  }
  r.us = (NowUs() - t0) / reps;
  return r;
}

// One line per report for scripts/train_text_model.py: every OOM event's
// model text and rule candidates (rules alone, before the text model).
void DumpCase(std::ostream& out, const Case& c, const char* set) {
  oomguard::kb::LogParseOptions o;
  o.source_name = c.file;
  auto incs = oomguard::kb::ParseOomLog(c.text, o);
  out << "{\"case\":" << JsonString(c.file) << ",\"set\":" << JsonString(set) << ",\"source\":"
      << JsonString(c.source) << ",\"repo\":" << JsonString(c.repo) << ",\"split\":" << JsonString(c.split)
      << ",\"batch\":" << JsonString(c.batch) << ",\"label\":" << JsonString(c.label) << ",\"events\":[";
  if (incs.ok()) {
    bool first = true;
    for (const auto& inc : *incs) {
      out << (first ? "" : ",") << "{\"text\":" << JsonString(std::string(oomguard::kb::ModelText(inc)))
          << ",\"rules\":[";
      bool f2 = true;
      for (const auto& cand : oomguard::kb::RuleCandidates(inc)) {
        out << (f2 ? "" : ",") << "[" << JsonString(cand.pattern) << "," << cand.confidence << "]";
        f2 = false;
      }
      out << "],\"ruled_out\":[";
      f2 = true;
      for (std::string_view p : oomguard::kb::RuledOut(inc)) {
        out << (f2 ? "" : ",") << JsonString(std::string(p));
        f2 = false;
      }
      out << "]}";
      first = false;
    }
  }
  out << "]}\n";
}

// {"label": {"answer": n, ...}, ...}
void WriteConfusion(std::ostream& out, const std::map<std::string, std::map<std::string, size_t>>& confusion) {
  out << "{";
  bool first = true;
  for (const auto& [label, row] : confusion) {
    out << (first ? "" : ",") << JsonString(label) << ":{";
    bool f2 = true;
    for (const auto& [answer, n] : row) {
      out << (f2 ? "" : ",") << JsonString(answer) << ":" << n;
      f2 = false;
    }
    out << "}";
    first = false;
  }
  out << "}";
}

struct CorpusScore {
  size_t right = 0, total = 0, found = 0, confident = 0, confident_wrong = 0;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, dump_path;
  int reps = 20;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--json=", 7) == 0) {
      json_path = argv[i] + 7;
    } else if (std::strncmp(argv[i], "--dump=", 7) == 0) {
      dump_path = argv[i] + 7;
    } else if (std::strncmp(argv[i], "--reps=", 7) == 0) {
      reps = std::atoi(argv[i] + 7);
      if (reps < 1) {
        std::fprintf(stderr, "diagnosis_bench: --reps must be a positive integer, got '%s'\n", argv[i] + 7);
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: diagnosis_bench [--json=PATH] [--dump=PATH] [--reps=N]\n");
      return 2;
    }
  }
  const std::string data = OOMGUARD_KB_TESTDATA;
  std::string error;
  std::vector<Case> cases = oomguard::devset::Load(data + "/reports", &error);
  if (!error.empty()) {
    std::fprintf(stderr, "diagnosis_bench: %s\n", error.c_str());
    return 1;
  }

  std::vector<Case> corpus = oomguard::devset::LoadCorpus(data + "/corpus", &error);
  if (!error.empty()) {
    std::fprintf(stderr, "diagnosis_bench: %s\n", error.c_str());
    return 1;
  }
  if (!dump_path.empty()) {
    std::ofstream dump(dump_path);
    for (const auto& c : cases) DumpCase(dump, c, "dev");
    for (const auto& c : corpus) DumpCase(dump, c, "corpus");
    if (!dump.good()) {
      std::fprintf(stderr, "diagnosis_bench: cannot write %s\n", dump_path.c_str());
      return 1;
    }
    std::printf("dumped %zu reports to %s\n", cases.size() + corpus.size(), dump_path.c_str());
    return 0;
  }

  // The corpus: accuracy by batch and by split, confident mistakes, OOMs found.
  std::map<std::string, CorpusScore> by_corpus_batch, by_split;
  std::map<std::string, std::map<std::string, size_t>> test_confusion;
  std::vector<std::pair<const Case*, Verdict>> corpus_wrong;
  for (const auto& c : corpus) {
    Verdict v = oomguard::devset::Diagnose(c);
    const bool ok = v.pattern == c.label;
    for (CorpusScore* sc : {&by_corpus_batch[c.batch], &by_split[c.split]}) {
      sc->right += ok;
      ++sc->total;
      sc->found += v.events > 0;
      if (v.confidence >= 0.8) {
        ++sc->confident;
        sc->confident_wrong += !ok;
      }
    }
    if (c.split == "test") ++test_confusion[c.label][v.pattern];
    if (!ok) corpus_wrong.emplace_back(&c, v);
  }
  for (const auto& [name, sc] : by_corpus_batch)
    std::printf("corpus %-10s %zu/%zu right, OOM found in %zu, %zu wrong of %zu at confidence >= 0.8\n",
                name.c_str(), sc.right, sc.total, sc.found, sc.confident_wrong, sc.confident);
  for (const auto& [name, sc] : by_split)
    std::printf("split  %-10s %zu/%zu right (%.1f%%), OOM found in %zu, %zu wrong of %zu at confidence >= 0.8\n",
                name.c_str(), sc.right, sc.total, sc.total ? 100.0 * sc.right / sc.total : 0.0, sc.found,
                sc.confident_wrong, sc.confident);

  // Verdicts, and the time of one pass over the set (mean of `reps` passes).
  std::vector<Verdict> verdicts(cases.size());
  const double t0 = NowUs();
  for (int k = 0; k < reps; ++k)
    for (size_t i = 0; i < cases.size(); ++i) verdicts[i] = oomguard::devset::Diagnose(cases[i]);
  const double us_per_report = (NowUs() - t0) / reps / static_cast<double>(cases.size());
  size_t bytes = 0;
  for (const auto& c : cases) bytes += c.text.size();

  size_t right = 0;
  double max_wrong_conf = 0;
  std::map<std::string, std::pair<size_t, size_t>> by_batch;  // batch -> (right, total)
  std::map<std::string, std::map<std::string, size_t>> confusion;
  std::set<std::string> answers;
  for (size_t i = 0; i < cases.size(); ++i) {
    const bool ok = verdicts[i].pattern == cases[i].label;
    right += ok;
    auto& b = by_batch[cases[i].batch];
    b.first += ok;
    ++b.second;
    ++confusion[cases[i].label][verdicts[i].pattern];
    answers.insert(verdicts[i].pattern);
    if (!ok && verdicts[i].confidence > max_wrong_conf) max_wrong_conf = verdicts[i].confidence;
  }

  std::vector<LogResult> logs;
  std::vector<std::filesystem::path> log_paths;
  for (const auto& e : std::filesystem::directory_iterator(data + "/logs"))
    if (e.path().filename() != "README.md") log_paths.push_back(e.path());
  std::sort(log_paths.begin(), log_paths.end());
  for (const auto& p : log_paths) logs.push_back(RunLog(p, reps));

  std::printf("dev set: %zu/%zu right (%.1f%%), most confident wrong answer %.2f\n", right, cases.size(),
              100.0 * right / cases.size(), max_wrong_conf);
  for (const auto& [batch, rt] : by_batch) std::printf("  %-12s %zu/%zu\n", batch.c_str(), rt.first, rt.second);
  std::printf("diagnosis: %.1f us per report (mean %zu bytes), %d passes\n", us_per_report, bytes / cases.size(),
              reps);
  for (size_t i = 0; i < cases.size(); ++i)
    if (verdicts[i].pattern != cases[i].label)
      std::printf("  wrong: %s  %s -> %s (%.2f)\n", cases[i].file.c_str(), cases[i].label.c_str(),
                  verdicts[i].pattern.c_str(), verdicts[i].confidence);
  for (const auto& l : logs) {
    std::printf("log %s: %zu OOM event(s) in %.1f us%s%s\n", l.file.c_str(), l.patterns.size(), l.us,
                l.error.empty() ? "" : ", error: ", l.error.c_str());
  }

  if (json_path.empty()) return 0;
  std::ofstream out(json_path);
  if (!out) {
    std::fprintf(stderr, "diagnosis_bench: cannot write %s\n", json_path.c_str());
    return 1;
  }
  out << "{\"reports\":" << cases.size() << ",\"right\":" << right << ",\"max_wrong_confidence\":" << max_wrong_conf
      << ",\"us_per_report\":" << us_per_report << ",\"mean_report_bytes\":" << bytes / cases.size()
      << ",\"passes\":" << reps << ",\"by_batch\":{";
  bool first = true;
  for (const auto& [batch, rt] : by_batch) {
    out << (first ? "" : ",") << JsonString(batch) << ":{\"right\":" << rt.first << ",\"total\":" << rt.second << "}";
    first = false;
  }
  out << "},\"confusion\":";
  WriteConfusion(out, confusion);
  out << ",\"wrong\":[";
  first = true;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (verdicts[i].pattern == cases[i].label) continue;
    out << (first ? "" : ",") << "{\"file\":" << JsonString(cases[i].file) << ",\"source\":"
        << JsonString(cases[i].source) << ",\"label\":" << JsonString(cases[i].label) << ",\"answer\":"
        << JsonString(verdicts[i].pattern) << ",\"confidence\":" << verdicts[i].confidence << "}";
    first = false;
  }
  out << "],\"corpus\":{\"by_batch\":{";
  first = true;
  auto score_json = [&](const CorpusScore& sc) {
    out << "{\"right\":" << sc.right << ",\"total\":" << sc.total << ",\"found\":" << sc.found
        << ",\"confident\":" << sc.confident << ",\"confident_wrong\":" << sc.confident_wrong << "}";
  };
  for (const auto& [name, sc] : by_corpus_batch) {
    out << (first ? "" : ",") << JsonString(name) << ":";
    score_json(sc);
    first = false;
  }
  out << "},\"by_split\":{";
  first = true;
  for (const auto& [name, sc] : by_split) {
    out << (first ? "" : ",") << JsonString(name) << ":";
    score_json(sc);
    first = false;
  }
  out << "},\"test_confusion\":";
  WriteConfusion(out, test_confusion);
  out << ",\"wrong\":[";
  first = true;
  for (const auto& [c, v] : corpus_wrong) {
    out << (first ? "" : ",") << "{\"file\":" << JsonString(c->file) << ",\"source\":" << JsonString(c->source)
        << ",\"split\":" << JsonString(c->split) << ",\"label\":" << JsonString(c->label)
        << ",\"answer\":" << JsonString(v.pattern) << ",\"confidence\":" << v.confidence << "}";
    first = false;
  }
  out << "]},\"logs\":[";
  first = true;
  for (const auto& l : logs) {
    out << (first ? "" : ",") << "{\"file\":" << JsonString(l.file) << ",\"bytes\":" << l.bytes
        << ",\"us\":" << l.us << ",\"error\":" << JsonString(l.error) << ",\"patterns\":[";
    for (size_t k = 0; k < l.patterns.size(); ++k) out << (k ? "," : "") << JsonString(l.patterns[k]);
    out << "]}";
    first = false;
  }
  out << "]}\n";
  return out.good() ? 0 : 1;
}
