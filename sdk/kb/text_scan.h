// Small text helpers shared by the text-cue analyzer's files (text_cues.cc,
// text_progress.cc, text_narrative.cc) and the log parser. Private to sdk/kb.
// Thread-safety: pure functions.
#ifndef OOMGUARD_SDK_KB_TEXT_SCAN_H_
#define OOMGUARD_SDK_KB_TEXT_SCAN_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sdk/kb/text_cues.h"

namespace oomguard::kb {
namespace text {

inline bool Contains(std::string_view hay, std::string_view needle) {
  return hay.find(needle) != std::string_view::npos;
}
inline bool ContainsAny(std::string_view hay, std::initializer_list<std::string_view> needles) {
  for (std::string_view n : needles)
    if (hay.find(n) != std::string_view::npos) return true;
  return false;
}
inline std::string Lower(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}
inline std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t' || s.front() == '\r')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r')) s.remove_suffix(1);
  return s;
}

// Splits into lines, drops ANSI colour codes and carriage-return overwrites
// (tqdm redraws a line with '\r'; the last drawing is what a reader sees).
void SplitClean(std::string_view text, std::vector<std::string>* lines);

// The first whole number at or after pos (digits with optional ',' groups and
// a 'k' suffix for thousands); nullopt when the next token is not a number.
std::optional<int64_t> NumberAt(std::string_view s, size_t pos);

}  // namespace text

// Fill the progress and description cues (text_progress.cc, text_narrative.cc).
// `lines` are the prefix-stripped lines as written (quotes come from them),
// `lower` the same lower-cased; progress is read from lines before `anchor`.
void ReadProgress(const std::vector<std::string>& lines, const std::vector<std::string>& lower, size_t anchor,
                  TextCues* cues);
// `all_lower` is the prose lower-cased; `all` the same text as written (same
// length, ASCII case folding keeps offsets), which the quotes are taken from.
void ReadDescription(std::string_view all_lower, std::string_view all, TextCues* cues);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_TEXT_SCAN_H_
