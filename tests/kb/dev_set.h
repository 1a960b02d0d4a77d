// The development set of real OOM reports (tests/kb/testdata/reports/): the
// reader shared by its accuracy test and by bench/diagnosis_bench.cc.
//
// A report is diagnosed the way `oomguard diagnose` diagnoses a file: the log
// importer finds its OOM events and the classifier classifies each; the most
// confident event speaks for the report (a report pasting its error twice
// yields one event; one that quotes a sentence and a traceback may yield two).
//
// Thread-safety: pure functions.
#ifndef OOMGUARD_TESTS_KB_DEV_SET_H_
#define OOMGUARD_TESTS_KB_DEV_SET_H_

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/log_parser.h"

namespace oomguard::devset {

struct Case {
  std::string file;    // "001-nanogpt-resume.txt"
  std::string source;  // the report's address
  std::string label;   // a catalogue pattern or "unknown"
  std::string why;
  std::string batch;   // "development", "held-out 1", ...
  std::string text;    // the report as quoted
};

struct Verdict {
  std::string pattern = "(no OOM found)";
  double confidence = 0;
  std::string evidence;
  size_t events = 0;
};

// Reads every NNN-*.txt of `dir`, sorted. On a malformed file returns what
// was read so far and sets *error naming the file.
inline std::vector<Case> Load(const std::string& dir, std::string* error) {
  std::vector<std::filesystem::path> paths;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().extension() == ".txt") paths.push_back(e.path());
  if (ec) {
    *error = dir + ": " + ec.message();
    return {};
  }
  std::sort(paths.begin(), paths.end());
  std::vector<Case> out;
  for (const auto& p : paths) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream buf;
    buf << in.rdbuf();
    const std::string all = buf.str();
    const size_t sep = all.find("\n----\n");
    if (sep == std::string::npos) {
      *error = p.string() + ": no '----' line between the header and the text";
      return out;
    }
    Case c;
    c.file = p.filename().string();
    c.text = all.substr(sep + 6);
    std::istringstream header(all.substr(0, sep));
    std::string line;
    while (std::getline(header, line)) {
      const size_t colon = line.find(": ");
      if (colon == std::string::npos) continue;
      const std::string key = line.substr(0, colon), value = line.substr(colon + 2);
      if (key == "source") c.source = value;
      else if (key == "label") c.label = value;
      else if (key == "why") c.why = value;
      else if (key == "batch") c.batch = value;
    }
    out.push_back(std::move(c));
  }
  return out;
}

inline Verdict Diagnose(const Case& c) {
  Verdict v;
  kb::LogParseOptions o;
  o.source_name = c.file;
  auto incs = kb::ParseOomLog(c.text, o);
  if (!incs.ok()) {
    v.pattern = "(error)";
    v.evidence = incs.status().ToString();
    return v;
  }
  v.events = incs->size();
  for (Incident& inc : *incs) {
    ClassifyInPlace(&inc);
    if (v.evidence.empty() || inc.confidence > v.confidence) {
      v.pattern = inc.pattern;
      v.confidence = inc.confidence;
      v.evidence = inc.evidence;
    }
  }
  return v;
}

}  // namespace oomguard::devset

#endif  // OOMGUARD_TESTS_KB_DEV_SET_H_
