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
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/log_parser.h"

namespace oomguard::devset {

struct Case {
  std::string file;    // "001-nanogpt-resume.txt", or "batch-1.txt#7" for a corpus record
  std::string source;  // the report's address
  std::string label;   // a catalogue pattern or "unknown"
  std::string why;     // the development set's reason, or the corpus's resolution
  std::string batch;   // "development", "held-out 1", ..., or the corpus file's batch ("batch-1")
  std::string text;    // the report as quoted
  std::string repo;    // "owner/name" (GitHub), else the host: the unit of the split
  std::string split;   // train, validation or test (Split(repo))
};

// The repository a report came from: "owner/name" of a GitHub address, else
// the host.
inline std::string RepoOf(const std::string& source) {
  std::string s = source;
  for (const char* scheme : {"https://", "http://"})
    if (s.rfind(scheme, 0) == 0) s = s.substr(std::string(scheme).size());
  std::string host = s.substr(0, s.find('/'));
  if (host != "github.com") return host;
  std::string rest = s.substr(host.size() + 1);
  size_t a = rest.find('/');
  size_t b = a == std::string::npos ? a : rest.find('/', a + 1);
  std::string repo = rest.substr(0, b);
  for (char& c : repo) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return repo;
}

// Deterministic split by repository, so no repository is in two splits:
// FNV-1a of the repository name, 6 in 10 train, 2 validation, 2 test.
// diagnosis_bench --dump hands it to scripts/train_text_model.py.
inline std::string Split(const std::string& repo) {
  uint64_t h = 14695981039346656037ull;
  for (char c : repo) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  const uint64_t bucket = h % 10;
  return bucket < 6 ? "train" : bucket < 8 ? "validation" : "test";
}

struct Verdict {
  std::string pattern = "(no OOM found)";
  double confidence = 0;
  std::string evidence;
  size_t events = 0;
};

// The .txt files of `dir` whose names start with `prefix`, sorted; sets
// *error when the directory cannot be read.
inline std::vector<std::filesystem::path> TextFiles(const std::string& dir, const std::string& prefix,
                                                    std::string* error) {
  std::vector<std::filesystem::path> paths;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec))
    if (e.path().extension() == ".txt" && e.path().filename().string().rfind(prefix, 0) == 0)
      paths.push_back(e.path());
  if (ec) {
    *error = dir + ": " + ec.message();
    return {};
  }
  std::sort(paths.begin(), paths.end());
  return paths;
}

// Reads every NNN-*.txt of `dir`, sorted. On a malformed file returns what
// was read so far and sets *error naming the file.
inline std::vector<Case> Load(const std::string& dir, std::string* error) {
  const std::vector<std::filesystem::path> paths = TextFiles(dir, "", error);
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
    c.repo = RepoOf(c.source);
    c.split = Split(c.repo);
    out.push_back(std::move(c));
  }
  return out;
}

// Reads the corpus (tests/kb/testdata/corpus/batch-*.txt): records separated
// by a "====" line, each a header (source, label, resolution) and the text
// after a "----" line. The batch is the file's name without ".txt".
inline std::vector<Case> LoadCorpus(const std::string& dir, std::string* error) {
  const std::vector<std::filesystem::path> paths = TextFiles(dir, "batch-", error);
  std::vector<Case> out;
  for (const auto& p : paths) {
    std::ifstream in(p, std::ios::binary);
    std::string line;
    std::vector<std::string> record;
    int n = 0;
    auto flush = [&]() -> bool {
      if (record.empty()) return true;
      ++n;
      Case c;
      c.file = p.filename().string() + "#" + std::to_string(n);
      c.batch = p.stem().string();
      size_t i = 0;
      for (; i < record.size() && record[i] != "----"; ++i) {
        const size_t colon = record[i].find(": ");
        if (colon == std::string::npos) continue;
        const std::string key = record[i].substr(0, colon), value = record[i].substr(colon + 2);
        if (key == "source") c.source = value;
        else if (key == "label") c.label = value;
        else if (key == "resolution") c.why = value;
      }
      if (i == record.size()) {
        *error = c.file + ": no '----' line between the header and the text";
        return false;
      }
      for (++i; i < record.size(); ++i) c.text += record[i] + "\n";
      c.repo = RepoOf(c.source);
      c.split = Split(c.repo);
      out.push_back(std::move(c));
      record.clear();
      return true;
    };
    while (std::getline(in, line)) {
      if (line == "====") {
        if (!flush()) return out;
        continue;
      }
      record.push_back(line);
    }
    if (!flush()) return out;
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
