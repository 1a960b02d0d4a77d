// Log lines: the prefixes launchers and loggers add (StripLinePrefix), and
// training progress (ReadProgress): tqdm bars, "Epoch [3][50/7330]", "step
// 95", "iter 144:", Hugging Face's {'epoch': 0.5}, and what was running
// (validation, loading weights, preparing data, resuming) before the OOM.
#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "sdk/kb/text_scan.h"

namespace oomguard::kb {
namespace text {

void SplitClean(std::string_view text, std::vector<std::string>* lines) {
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    // tqdm redraws with '\r': keep what follows the last one that has text.
    if (size_t cr = line.find_last_of('\r'); cr != std::string_view::npos && cr + 1 < line.size())
      line = line.substr(cr + 1);
    std::string clean;
    clean.reserve(line.size());
    for (size_t i = 0; i < line.size(); ++i) {
      if (line[i] == '\x1b' && i + 1 < line.size() && line[i + 1] == '[') {  // ANSI colour
        i += 2;
        while (i < line.size() && !std::isalpha(static_cast<unsigned char>(line[i]))) ++i;
        continue;
      }
      if (line[i] != '\r') clean.push_back(line[i]);
    }
    lines->push_back(std::move(clean));
    if (end == text.size()) break;
    start = end + 1;
  }
}

std::optional<int64_t> NumberAt(std::string_view s, size_t pos) {
  while (pos < s.size() && (s[pos] == ' ' || s[pos] == '~')) ++pos;
  size_t start = pos;
  std::string digits;
  while (pos < s.size() && (std::isdigit(static_cast<unsigned char>(s[pos])) ||
                            (s[pos] == ',' && pos + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[pos + 1]))))) {
    if (s[pos] != ',') digits.push_back(s[pos]);
    ++pos;
  }
  if (pos == start || digits.size() > 15) return std::nullopt;
  int64_t v = std::strtoll(digits.c_str(), nullptr, 10);
  if (pos < s.size() && (s[pos] == 'k' || s[pos] == 'K') &&
      (pos + 1 == s.size() || !std::isalpha(static_cast<unsigned char>(s[pos + 1]))))
    v *= 1000;
  return v;
}

}  // namespace text

namespace {

using text::Contains;
using text::ContainsAny;
using text::NumberAt;

bool AllDigits(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return std::isdigit(static_cast<unsigned char>(c)); });
}

bool IsLevel(std::string_view t) {
  static constexpr std::string_view kLevels[] = {"info", "info:", "warning", "warning:", "warn", "warn:", "error",
                                                 "error:", "debug", "debug:", "critical", "fatal", "trace", "-",
                                                 "|", ":", "kernel:"};
  std::string l = text::Lower(t);
  for (std::string_view k : kLevels)
    if (l == k) return true;
  // glog: "E0524", "I0524"
  return t.size() == 5 && (t[0] == 'E' || t[0] == 'I' || t[0] == 'W') && AllDigits(t.substr(1));
}

bool IsDateOrTime(std::string_view t) {
  if (t.empty() || !std::isdigit(static_cast<unsigned char>(t[0]))) return false;
  int digits = 0, seps = 0;
  for (char c : t) {
    if (std::isdigit(static_cast<unsigned char>(c))) ++digits;
    else if (c == '-' || c == ':' || c == '.' || c == ',' || c == 'T' || c == '+' || c == '/') ++seps;
    else return false;
  }
  return seps >= 1 && digits >= 4;
}

bool IsMonthOrDay(std::string_view t) {
  static constexpr std::string_view kNames[] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                                "Nov", "Dec", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"};
  for (std::string_view n : kNames)
    if (t == n) return true;
  return t.size() <= 2 && AllDigits(t);
}

// "[rank3]:", "[default3]:", "[Rank 3]", "[1,3]<stderr>:"; -1: not a rank tag.
int RankTag(std::string_view t) {
  std::string l = text::Lower(t);
  for (std::string_view key : {"[rank", "[default", "[1,"}) {
    if (l.rfind(key, 0) != 0) continue;
    size_t pos = key.size();
    while (pos < l.size() && l[pos] == ' ') ++pos;
    if (auto n = NumberAt(l, pos)) return static_cast<int>(*n);
  }
  return -1;
}

}  // namespace

std::string_view StripLinePrefix(std::string_view line, int* rank, std::string* host) {
  std::string_view s = line;
  for (int round = 0; round < 12; ++round) {
    size_t lead = 0;
    while (lead < s.size() && (s[lead] == ' ' || s[lead] == '\t')) ++lead;
    std::string_view rest = s.substr(lead);
    if (rest.empty()) return s;
    if (rest.substr(0, 2) == "> " || rest.substr(0, 2) == "# ") {
      s = rest.substr(2);
      continue;
    }
    size_t end = rest.find_first_of(" \t");
    std::string_view tok = rest.substr(0, end == std::string_view::npos ? rest.size() : end);
    std::string_view after = end == std::string_view::npos ? std::string_view() : rest.substr(end + 1);
    if (tok.front() == '[' || tok.front() == '(') {
      // A bracketed group may hold spaces ("[  518.050606]", "(train pid=1)").
      char close = tok.front() == '[' ? ']' : ')';
      size_t c = rest.find(close);
      if (c == std::string_view::npos || c > 80) return s;
      std::string_view group = rest.substr(0, c + 1);
      if (close == ')' && !Contains(group, "pid=")) return s;
      std::string_view tail = rest.substr(c + 1);
      if (int r = RankTag(rest.substr(0, c + 1)); r >= 0) {
        *rank = r;
      } else {
        bool stamp = false;
        for (char ch : group) stamp |= std::isdigit(static_cast<unsigned char>(ch)) != 0;
        std::string g = text::Lower(group);
        stamp |= ContainsAny(g, {"info", "warn", "error", "debug", "driver", "launch"});
        if (!stamp) return s;
        if (group.size() <= 6 && AllDigits(text::Trim(group.substr(1, group.size() - 2))) && *rank < 0 &&
            !host->empty())
          *rank = std::atoi(std::string(text::Trim(group.substr(1, group.size() - 2))).c_str());  // NCCL "[3]"
      }
      if (!tail.empty() && tail.front() == ':') tail.remove_prefix(1);
      if (!tail.empty() && tail.front() != ' ' && tail.front() != '[') return s;  // "[0/795]Killed"
      s = tail;
      continue;
    }
    if (IsDateOrTime(tok) || IsLevel(tok) || (IsMonthOrDay(tok) && round < 4)) {
      s = after;
      continue;
    }
    // NCCL: "host:pid:tid [3] ..."
    if (size_t c1 = tok.find(':'); c1 != std::string_view::npos && c1 > 0 &&
                                   std::any_of(tok.begin(), tok.begin() + static_cast<std::ptrdiff_t>(c1),
                                               [](char ch) { return std::isalpha(static_cast<unsigned char>(ch)); })) {
      size_t c2 = tok.find(':', c1 + 1);
      if (c2 != std::string_view::npos && AllDigits(tok.substr(c1 + 1, c2 - c1 - 1)) && AllDigits(tok.substr(c2 + 1))) {
        *host = std::string(tok.substr(0, c1));
        s = after;
        continue;
      }
    }
    // "RANK 3:", "Rank 3 :" (launchers that print the rank as two words).
    if (text::Lower(tok) == "rank" && !after.empty() && std::isdigit(static_cast<unsigned char>(after.front()))) {
      size_t d = 0;
      while (d < after.size() && std::isdigit(static_cast<unsigned char>(after[d]))) ++d;
      size_t colon = d;
      while (colon < after.size() && after[colon] == ' ') ++colon;
      if (d <= 6 && colon < after.size() && after[colon] == ':') {
        *rank = std::atoi(std::string(after.substr(0, d)).c_str());
        s = after.substr(colon + 1);
        continue;
      }
    }
    // "worker-5:", "0:" (srun -l), "rank3:"
    if (tok.size() > 1 && tok.back() == ':' && tok.size() < 24 && !Contains(tok, "/") && !Contains(tok, ".py")) {
      std::string_view name = tok.substr(0, tok.size() - 1);
      std::string l = text::Lower(name);
      if (AllDigits(name)) {
        if (*rank < 0) *rank = std::atoi(std::string(name).c_str());
        s = after;
        continue;
      }
      if (l.rfind("rank", 0) == 0 && AllDigits(l.substr(4))) {
        *rank = std::atoi(l.substr(4).c_str());
        s = after;
        continue;
      }
      if (Contains(l, "worker") || Contains(l, "node")) {
        s = after;
        continue;
      }
    }
    // syslog "host kernel:" and "host proc[pid]" after a timestamp.
    if (round > 0 && !after.empty()) {
      size_t e2 = after.find_first_of(" \t");
      std::string_view next = after.substr(0, e2);
      // "proc[14429]": a name with a pid, as syslog writes the sender.
      size_t open = next.find('[');
      bool proc_pid = open != std::string_view::npos && open > 0 && next.back() == ']' &&
                      AllDigits(next.substr(open + 1, next.size() - open - 2));
      if (next == "kernel:" || proc_pid) {
        *host = std::string(tok);
        s = e2 == std::string_view::npos ? std::string_view() : after.substr(e2 + 1);
        continue;
      }
    }
    return s;  // keeps indentation: code under a traceback frame is indented
  }
  return s;
}

namespace {

struct Progress {
  std::optional<int64_t> epoch, count, total;
  bool eval = false, load = false, data = false;
};

// "N/M" followed by " [" or "]" or ", " (tqdm, "[515/1422]", "Batch: 4800/15072,").
bool Fraction(std::string_view l, Progress* p) {
  for (size_t slash = l.find('/'); slash != std::string_view::npos; slash = l.find('/', slash + 1)) {
    size_t left = slash;
    while (left > 0 && l[left - 1] == ' ' && slash - left < 2) --left;  // "1464 / 1464"
    if (left == 0 || !std::isdigit(static_cast<unsigned char>(l[left - 1]))) continue;
    size_t b = left;
    while (b > 0 && (std::isdigit(static_cast<unsigned char>(l[b - 1])) || l[b - 1] == ',')) --b;
    if (b > 0 && (std::isalpha(static_cast<unsigned char>(l[b - 1])) || l[b - 1] == '.' || l[b - 1] == '/')) continue;
    auto num = NumberAt(l, b);
    auto den = NumberAt(l, slash + 1);
    if (!num || !den || *den == 0) continue;
    size_t e = slash + 1;
    while (e < l.size() && l[e] == ' ') ++e;
    while (e < l.size() && (std::isdigit(static_cast<unsigned char>(l[e])) ||
                            (l[e] == ',' && e + 1 < l.size() && std::isdigit(static_cast<unsigned char>(l[e + 1])))))
      ++e;
    std::string_view next = l.substr(e, 2);
    bool bracketed = b > 0 && l[b - 1] == '[';
    if (!bracketed && next != " [" && next.substr(0, 1) != "[" && next != ", " && next.substr(0, 1) != "]" &&
        !Contains(l, "%|"))
      continue;
    // "Epoch 1/10" is an epoch count, not a step.
    if (b >= 6 && Contains(l.substr(b >= 8 ? b - 8 : 0, 8), "epoch")) {
      p->epoch = num;
      continue;
    }
    p->count = num;
    p->total = den;
    return true;
  }
  return false;
}

std::optional<int64_t> AfterWord(std::string_view l, std::string_view word) {
  for (size_t at = l.find(word); at != std::string_view::npos; at = l.find(word, at + 1)) {
    if (at > 0 && std::isalpha(static_cast<unsigned char>(l[at - 1]))) continue;
    size_t pos = at + word.size();
    if (pos < l.size() && std::isalpha(static_cast<unsigned char>(l[pos]))) continue;
    while (pos < l.size() && (l[pos] == ' ' || l[pos] == ':' || l[pos] == '=' || l[pos] == '[' || l[pos] == '\'' ||
                              l[pos] == '"' || l[pos] == '#'))
      ++pos;
    if (auto n = NumberAt(l, pos)) return n;
  }
  return std::nullopt;
}

std::optional<Progress> ParseProgress(std::string_view l) {
  Progress p;
  bool fraction = Fraction(l, &p);
  if (!p.epoch) p.epoch = AfterWord(l, "epoch");
  if (!p.epoch && Contains(l, " train")) p.epoch = AfterWord(l, "ep");
  if (!fraction) {
    for (std::string_view w : {"global_step", "step", "iteration", "iter"}) {
      if (auto n = AfterWord(l, w)) {
        p.count = n;
        break;
      }
    }
  }
  if (!p.epoch && !p.count) return std::nullopt;
  // Not progress: frames ("line 12"), processes ("pid 3"), devices ("gpu 0").
  if (ContainsAny(l, {"file \"", ", line ", "frame #", "tried to allocate"})) return std::nullopt;
  p.eval = ContainsAny(l, {"valid", "evaluat", "eval ", "eval:", "testing", "test:", "(val", " val "}) &&
           !Contains(l, "(train");
  p.load = ContainsAny(l, {"loading checkpoint shards", "loading weights", "loading model", "loading pipeline"});
  // Other "Loading ..." bars before training read the dataset (labels, paths, files).
  p.data = ContainsAny(l, {"processing", "tokeniz", "map:", "map (", "preprocess", "filter", "downloading"}) ||
           (Contains(l, "loading") && !p.load);
  return p;
}

// Line i as written, for a quote: trimmed, runs of blanks (a progress bar's
// empty part) shortened, at most `max` bytes.
std::string Quote(const std::vector<std::string>& lines, size_t i, size_t max) {
  std::string out;
  for (char ch : text::Trim(lines[i])) {
    if (ch == ' ' && out.size() >= 2 && out[out.size() - 1] == ' ' && out[out.size() - 2] == ' ') continue;
    out.push_back(ch);
  }
  return out.substr(0, max);
}

}  // namespace

void ReadProgress(const std::vector<std::string>& lines, const std::vector<std::string>& lower, size_t anchor,
                  TextCues* c) {
  std::optional<Progress> last_train;
  std::string last_train_line;
  int64_t max_count = -1, max_epoch = -1;
  bool epoch_complete = false;
  bool after_prep = false;
  std::string last_eval;  // the evaluation progress line, while no training progress followed it
  for (size_t i = 0; i < lower.size() && i <= anchor; ++i) {
    const std::string& l = lower[i];
    if (i < anchor && ContainsAny(l, {"restoring states from the checkpoint", "loaded model weights from checkpoint",
                                      "resuming from", "resuming training", "resumed from", "restored from checkpoint",
                                      "load checkpoint from", "loading checkpoint from", "loaded checkpoint"}) &&
        !Contains(l, "resume_from_checkpoint"))
      c->resumed.Set("log line \"" + Quote(lines, i, 120) + "\"");
    auto p = ParseProgress(l);
    const bool prep_line = ContainsAny(l, {"processing", "tokenizing", "preprocessing", "building dataset"});
    if (prep_line && i + 4 >= anchor) c->data_prep.Set("log line \"" + Quote(lines, i, 80) + "\"");
    if (p && after_prep) p->data = true;  // a bar right under "Processing..." belongs to it
    after_prep = prep_line || (after_prep && p && p->data);
    if (!p) {
      if (i + 3 >= anchor && i < anchor && ContainsAny(l, {"saving checkpoint", "saving model", "saving lora", "save checkpoint"}) &&
          c->phase.empty()) {
        c->phase = "checkpoint";
        c->phase_why = "log line \"" + Quote(lines, i, 80) + "\" right before the OOM";
      }
      continue;
    }
    std::string quoted = Quote(lines, i, 120);
    if (p->load) c->loading_weights.Set("progress line \"" + quoted + "\"");
    if (p->data && !p->load) c->data_prep.Set("progress line \"" + quoted + "\"");
    if (p->eval) {
      last_eval = "progress line \"" + quoted + "\"";
      continue;
    }
    last_eval.clear();  // training progress after an evaluation: the evaluation is over
    if (i == anchor) continue;  // the OOM line itself ("3/8 [..]Killed") is not a completed step
    if (p->load || p->data) continue;
    if (p->epoch) max_epoch = std::max(max_epoch, *p->epoch);
    if (p->count) max_count = std::max(max_count, *p->count);
    if (p->count && p->total && *p->count == *p->total && *p->total > 1) epoch_complete = true;
    last_train = p;
    last_train_line = quoted;
  }
  if (!last_eval.empty()) c->eval.Set(last_eval);
  if (!last_train) return;
  // Logs count steps within an epoch; the epoch number says more ran before.
  if (max_epoch >= 0) c->epochs_done = std::max<int64_t>(0, max_epoch - 1) + (epoch_complete ? 1 : 0);
  if (last_train->count) c->step = last_train->count;
  if (max_count >= 0) c->steps_done = max_count;
  c->progress_why = "progress line \"" + last_train_line + "\"";
  bool nothing_done = max_count <= 0 && (!c->epochs_done || *c->epochs_done == 0) && last_train->count &&
                      *last_train->count == 0;
  if (nothing_done) c->first_step.Set(c->progress_why + " shows no completed step");
}

}  // namespace oomguard::kb
