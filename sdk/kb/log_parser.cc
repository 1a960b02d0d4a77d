// ParseOomLog (log_parser.h): OOM lines -> events -> incidents.
//
// A line is an OOM line when ClassifyMessage calls it one *and* it carries a
// format marker of a real error record ("CUDA out of memory", "NCCL WARN",
// "Out of memory: Killed process", a bare "Killed" after a progress bar...):
// a sentence that merely says "out of memory" is a mention, used only when
// the text has no error record at all (a report that describes its OOM in
// words).
#include "sdk/kb/log_parser.h"

#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdio>
#include <ctime>

#include "oomguard/oom.h"
#include "sdk/kb/text_scan.h"
#include "sdk/memory/incident_kind.h"
#include "sdk/memory/oom_message.h"

namespace oomguard::kb {
namespace {

using text::Contains;
using text::ContainsAny;
using text::Lower;
using text::Trim;

constexpr size_t kMaxText = size_t{256} << 20;
constexpr size_t kMaxContext = 16 * 1024;
constexpr size_t kMaxMessage = 8 * 1024;

struct Line {
  std::string raw;       // as read (ANSI codes removed)
  std::string stripped;  // launcher/logger prefixes removed, trimmed
  std::string lower;
  int rank = -1;
  std::string host;
};

// A bare SIGKILL: the shell's "Killed", alone or after a progress bar
// ("3/8 [00:02<00:03]Killed"), or bash's "line 28:  8156 Killed  python ...".
bool BareKill(std::string_view l) {
  std::string_view t = Trim(l);
  // A title's "Killed!" or "Killed！" (a full-width mark) is the same word.
  std::string_view word = t;
  for (bool cut = true; cut;) {
    cut = false;
    for (std::string_view mark : {"!", "?", ".", "！", "？", "。"})
      if (word.size() > mark.size() && word.ends_with(mark)) word.remove_suffix(mark.size()), cut = true;
  }
  if (word == "killed" || word == "**killed**") return true;
  // "# killed in save ply", "# Killed when saving LoRA weights": the kill opens the line and
  // says when it came (not "Killed processes: 3", nor "killed the job myself").
  if (t.starts_with("killed ")) {
    std::string_view rest = t.substr(7);
    for (std::string_view when : {"in ", "when ", "while ", "during ", "at ", "after ", "on ", "before "})
      if (rest.starts_with(when)) return true;
  }
  // The shell's "Killed" in a Chinese locale ("已杀死"), alone or after a progress bar.
  if (size_t at = t.find("已杀死"); at != std::string_view::npos &&
      (at == 0 || t[at - 1] == ']' || Contains(t.substr(0, at), "it/s")))
    return true;
  if (t.size() > 7 && t.substr(t.size() - 6) == "killed" && (t[t.size() - 7] == ']' || Contains(t, "it/s")))
    return true;
  // A progress bar's "]Killed" quoted inside a sentence or a title
  // ("Loading checkpoint shards: 0%| | 0/2 [00:00<?, ?it/s]Killed").
  if (size_t at = t.find("]killed"); at != std::string_view::npos && Contains(t.substr(0, at), "/"))
    return true;
  size_t at = t.find(" killed ");
  if (at == std::string_view::npos) return false;
  size_t b = at;
  while (b > 0 && std::isdigit(static_cast<unsigned char>(t[b - 1]))) --b;
  return b < at && (b == 0 || t[b - 1] == ' ');
}

// The markers of an error record (lower case).
bool FormatMarker(std::string_view l) {
  return ContainsAny(l, {"cuda out of memory", "cuda error: out of memory", "tried to allocate", "npu out of memory",
                         "xpu out of memory", "hip out of memory", "mps backend out of memory", "outofmemoryerror",
                         "cuda runtime error", "thcudacheck", "cudaerrormemoryallocation", "cudamalloc",
                         "oom when allocating", "resourceexhaustederror", "resource_exhausted", "resource exhausted",
                         "ran out of memory trying", "_status_alloc_failed", "cublas handle", "nccl warn",
                         "cuda calloc", "cuda failure", "defaultcpuallocator", "bad_alloc", "bad allocation",
                         "memoryerror", "cannot allocate memory", "can't allocate memory", "out of memory: killed",
                         "oom-kill", "oom_kill", "oomkilled", "killed by signal", "exit code 137", "exitcode: 137",
                         "sigkill", ": out of memory", "error: out of memory", "not enough memory:",
                         "cuda_error_out_of_memory", "insufficient shared memory", "out of shared memory",
                         "return code = -9", "return code -9", "exitcode: -9", "exit code -9", "错误码-9",
                         "cudnn_status_not_supported", "cublas_status_not_initialized",
                         "less than desired gpu memory utilization", "no available memory for the cache blocks",
                         "could not create cudnn handle", "can be stored in kv cache",
                         // PaddlePaddle 1.x: "Insufficient GPU memory to allocation."
                         "insufficient gpu memory",
                         // PyTorch's file mapping: "RuntimeError: unable to mmap 33484977464 bytes".
                         "unable to mmap",
                         // Docker Compose: "server-1 exited with code 137".
                         "exited with code 137",
                         // Metal (Apple silicon) refusing a command buffer for memory: MLX's "[METAL] Command
                         // buffer execution failed: Insufficient Memory", Metal's code as llama.cpp prints it
                         // ("error: Insufficient Memory (00000008:kIOGPUCommandBufferCallbackErrorOutOfMemory)"),
                         // and the code's older name "Insufficient Memory (IOAF code 8)".
                         "command buffer execution failed: insufficient memory",
                         "kiogpucommandbuffercallbackerroroutofmemory", "insufficient memory (ioaf code 8)",
                         // MLX: "[metal::malloc] Attempting to allocate 86587211776 bytes which is greater than
                         // the maximum allowed buffer size of 86586540032 bytes."
                         "maximum allowed buffer size",
                         // ggml's allocator (llama.cpp): "ggml_gallocr_reserve_n: failed to allocate ROCm0 buffer
                         // of size 18035509504"; ClassifyMessage tells the backend's memory from a refusal.
                         "buffer of size",
                         // Ollama: "Error: llama runner exited, you may not have enough available memory to run
                         // this model".
                         "llama runner exited",
                         // Ollama: "model requires more system memory (19.3 GiB) than is available (14.8 GiB)".
                         "requires more system memory (",
                         // Windows out of commit: "[WinError 1455] The paging file is too small for this
                         // operation to complete" (Chinese: "页面文件太小"); MLX's "[malloc_or_wait] Unable to
                         // allocate N bytes"; TGI's "Not enough memory to handle N total tokens"; DyNet's
                         // "CPU memory allocation failed n=N".
                         "winerror 1455", "paging file is too small", "页面文件太小", "[malloc_or_wait]",
                         "not enough memory to handle", "memory allocation failed n="});
}

// A byte size in words: "286GB", "~4 GiB", "512 MiB".
bool HasSize(std::string_view l) {
  for (size_t i = 0; i < l.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(l[i]))) continue;
    size_t j = i;
    while (j < l.size() && (std::isdigit(static_cast<unsigned char>(l[j])) || l[j] == '.')) ++j;
    if (j < l.size() && l[j] == ' ') ++j;
    std::string_view unit = l.substr(j, 3);
    if (unit.size() >= 2 && std::string_view("kmgt").find(unit[0]) != std::string_view::npos &&
        (unit[1] == 'b' || (unit.size() == 3 && unit[1] == 'i' && unit[2] == 'b')))
      return true;
    i = j;
  }
  return false;
}

// `word` with no letter on either side ("ram" in "RAM" or "ram," but not in "program").
bool HasWord(std::string_view l, std::string_view word) {
  for (size_t at = l.find(word); at != std::string_view::npos; at = l.find(word, at + 1)) {
    const bool left = at == 0 || !std::isalpha(static_cast<unsigned char>(l[at - 1]));
    const size_t end = at + word.size();
    const bool right = end >= l.size() || !std::isalpha(static_cast<unsigned char>(l[end]));
    if (left && right) return true;
  }
  return false;
}

// "memory", or "RAM"/"VRAM" as a word (not "program", "parameter").
bool MemoryWord(std::string_view l) { return Contains(l, "memory") || HasWord(l, "ram") || HasWord(l, "vram"); }

// One of `words` in the `span` bytes right before `at`: what the readers below ask of the
// words just before a failure word.
bool WordsJustBefore(std::string_view l, size_t at, size_t span, std::initializer_list<std::string_view> words) {
  const size_t from = at >= span ? at - span : 0;
  return ContainsAny(l.substr(from, at - from), words);
}

// A denial a few words before `at` ("it won't crash due to low memory", "the disk never ran out").
bool DeniedJustBefore(std::string_view l, size_t at) {
  return WordsJustBefore(l, at, 12, {"not ", "n't ", "never ", "no longer "});
}

// A negation in the three CJK characters before `at` ("显存没有爆", "内存增长不会溢出").
bool ChineseNegatedJustBefore(std::string_view l, size_t at) { return WordsJustBefore(l, at, 9, {"没", "不", "未"}); }

// A kill denied, averted or supposed in the four CJK characters before `at` ("没有被killed",
// "不会被kill", "以免被kill掉", "防止被killed", "怕被kill", "如果被killed").
bool ChineseKillAvertedJustBefore(std::string_view l, size_t at) {
  return WordsJustBefore(l, at, 12, {"没", "不", "未", "别", "免", "防", "怕", "如果"});
}

// A condition rather than a report: "if there is not enough memory on the GPU, ...".
bool Conditional(std::string_view before) {
  return ContainsAny(before, {"if ", "when ", "whether ", "in case", "unless "});
}

// "the process is always killed inexplicably": "killed" after "is"/"was"/"gets"... and one
// adverb. "is not killed", "was never killed" stay quiet (no adverb of a kill that happened).
bool KilledAfterAdverb(std::string_view l) {
  auto word_before = [&l](size_t end) -> std::pair<std::string_view, size_t> {
    while (end > 0 && l[end - 1] == ' ') --end;
    size_t b = end;
    while (b > 0 && std::isalpha(static_cast<unsigned char>(l[b - 1]))) --b;
    return {l.substr(b, end - b), b};
  };
  for (size_t at = l.find(" killed"); at != std::string_view::npos; at = l.find(" killed", at + 1)) {
    if (at + 7 < l.size() && std::isalpha(static_cast<unsigned char>(l[at + 7]))) continue;
    auto [adverb, b] = word_before(at);
    if (!(adverb == "always" || adverb == "often" || adverb == "sometimes" || adverb == "suddenly" ||
          adverb == "randomly" || adverb == "constantly" || adverb == "eventually" || adverb == "just" ||
          adverb == "simply" || adverb == "silently" || adverb == "immediately" || adverb == "frequently" ||
          adverb == "repeatedly" || adverb == "still" || adverb == "then" || adverb == "also" ||
          adverb == "inexplicably" || adverb == "unexpectedly" || adverb == "automatically" || adverb == "again"))
      continue;
    auto [verb, unused] = word_before(b);
    if (verb == "is" || verb == "was" || verb == "are" || verb == "were" || verb == "gets" || verb == "got" ||
        verb == "get" || verb == "been" || verb == "being" || verb == "be")
      return true;
  }
  // "why i can not train ? lt always kill ?": the verb's bare form after the adverb, said of the
  // run ("it", misspelt "lt"), not by the reporter ("I always kill the job after an hour").
  for (std::string_view bare : {std::string_view(" kill"), std::string_view(" kills")}) {
    for (size_t at = l.find(bare); at != std::string_view::npos; at = l.find(bare, at + 1)) {
      if (at + bare.size() < l.size() && std::isalpha(static_cast<unsigned char>(l[at + bare.size()]))) continue;
      auto [adverb, b] = word_before(at);
      if (!(adverb == "always" || adverb == "often" || adverb == "sometimes" || adverb == "randomly" ||
            adverb == "suddenly" || adverb == "constantly"))
        continue;
      auto [subject, unused] = word_before(b);
      if (subject == "it" || subject == "lt" || subject == "process" || subject == "program" || subject == "training")
        return true;
    }
  }
  return false;
}

// "There are about 40GB RAM on my machine, but even before the first epoch finished, it already
// ran out": "ran out" (runs, run, running) closing a clause in a line that named the memory
// before it; "ran out of <something>" is read elsewhere, and "ran out of time" is not memory.
bool RanOutAfterMemory(std::string_view l) {
  for (std::string_view verb : {std::string_view("ran out"), std::string_view("runs out"),
                                std::string_view("run out"), std::string_view("running out")}) {
    for (size_t at = l.find(verb); at != std::string_view::npos; at = l.find(verb, at + 1)) {
      if (at > 0 && std::isalpha(static_cast<unsigned char>(l[at - 1]))) continue;
      std::string_view rest = l.substr(at + verb.size());
      if (!rest.empty() && (std::isalpha(static_cast<unsigned char>(rest[0])) || rest.starts_with(" of"))) continue;
      std::string_view before = l.substr(0, at);
      if (!MemoryWord(before) || Conditional(before)) continue;
      if (DeniedJustBefore(l, at)) continue;
      return true;
    }
  }
  return false;
}

// "显存会一直增加到爆了" (the GPU memory keeps growing until it bursts): 显存/内存 and, a few
// characters on, "爆了"/"爆掉"/"到爆", not negated ("显存没有爆", "内存不会爆").
bool ChineseMemoryBurst(std::string_view l) {
  for (std::string_view mem : {std::string_view("显存"), std::string_view("内存")}) {
    for (size_t at = l.find(mem); at != std::string_view::npos; at = l.find(mem, at + 1)) {
      std::string_view rest = l.substr(at + mem.size(), 45);
      for (std::string_view burst : {std::string_view("爆了"), std::string_view("爆掉"), std::string_view("到爆")}) {
        size_t b = rest.find(burst);
        if (b == std::string_view::npos) continue;
        if (burst == "到爆") b += 3;  // where 爆 is
        // The three characters before 爆 hold no negation.
        if (!ChineseNegatedJustBefore(rest, b)) return true;
      }
    }
  }
  return false;
}

// What follows a phrase up to the end of the line, trailing spaces and punctuation removed.
std::string_view RestOfLine(std::string_view l, size_t from) {
  std::string_view rest = l.substr(std::min(from, l.size()));
  while (!rest.empty() && (rest.back() == ' ' || std::ispunct(static_cast<unsigned char>(rest.back()))))
    rest.remove_suffix(1);
  while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
  return rest;
}

// A memory word at most three words into `rest`: "memory", "memories", the misspellings reports
// carry ("memeory", "memery"), "RAM", "VRAM", "HBM".
bool MemoryWithinWords(std::string_view rest) {
  int words = 0;
  for (size_t k = 0; k < rest.size() && words < 4; ++words) {
    size_t end = rest.find_first_of(" .,;:!?)", k);
    std::string_view w = rest.substr(k, end == std::string_view::npos ? std::string_view::npos : end - k);
    if ((w.starts_with("mem") && !w.starts_with("member")) || w == "ram" || w == "vram" || w == "hbm") return true;
    if (end == std::string_view::npos || rest[end] != ' ') break;
    k = end + 1;
  }
  return false;
}

// "# try to train 1024 resolution memory out", "use RTX 3090 24G，Train one memory out of":
// "memory out" for "out of memory", ending the line (or with a dangling "of"). Not "memory
// outside"/"memory output" (a longer word), nor memory moved out ("swap the memory out").
bool MemoryOutAtEnd(std::string_view l) {
  for (size_t at = l.find("memory out"); at != std::string_view::npos; at = l.find("memory out", at + 1)) {
    std::string_view rest = RestOfLine(l, at + 10);
    if (!rest.empty() && rest != "of") continue;
    if (ContainsAny(l.substr(0, at), {"swap", "page", "paging", "offload", "move", "moving", "copy", "copie", "flush",
                                      "evict", "spill", "transfer", "print", "dump", "take", "taking", "took",
                                      "keep", "kept", "pull", "push"}))
      continue;
    return true;
  }
  return false;
}

// "进程被killed了" (the process was killed): the passive 被 and "kill(ed)"; not negated or
// averted in the four characters before 被 ("没有被killed", "不会被kill", "以免被kill掉",
// "防止被killed", "怕被kill", "如果被killed").
bool ChinesePassiveKill(std::string_view l) {
  static constexpr std::string_view kBei = "被";
  for (size_t at = l.find(kBei); at != std::string_view::npos; at = l.find(kBei, at + 1)) {
    std::string_view rest = l.substr(at + kBei.size());
    while (!rest.empty() && rest.front() == ' ') rest.remove_prefix(1);
    if (!rest.starts_with("kill")) continue;
    if (ChineseKillAvertedJustBefore(l, at)) continue;
    return true;
  }
  return false;
}

// "推理时模型加载Killed了" (the model's load got Killed at inference): the shell's word inside a
// Chinese sentence, a CJK character right before it or 了 right after, not negated or averted in
// the four characters before it ("没有killed", "以免killed").
bool KilledInChinese(std::string_view l) {
  for (size_t at = l.find("killed"); at != std::string_view::npos; at = l.find("killed", at + 1)) {
    const bool cjk_before = at >= 3 && static_cast<unsigned char>(l[at - 1]) >= 0x80;
    const bool le_after = l.substr(at + 6).starts_with("了");
    if (!cjk_before && !le_after) continue;
    if (!cjk_before && at > 0 && std::isalpha(static_cast<unsigned char>(l[at - 1]))) continue;
    if (ChineseKillAvertedJustBefore(l, at)) continue;
    return true;
  }
  return false;
}

// "识别时内存一直涨 溢出" (while recognising, the RAM keeps rising, overflow): 内存/显存, a growth
// character (涨/增/升/长) and then 溢出 within ten characters, or a crash (崩溃/崩了/挂了) within
// fifteen, not negated in the three characters before it ("内存一直涨但没有溢出", "内存增长不会溢出",
// "内存一直升高，但是程序没有崩溃"). Adjacent "内存溢出" is matched above; 溢出 alone is too wide
// ("内存中的整数溢出", an integer overflow in memory, has no growth).
bool ChineseMemoryGrowsToOverflow(std::string_view l) {
  for (std::string_view mem : {std::string_view("显存"), std::string_view("内存")}) {
    for (size_t at = l.find(mem); at != std::string_view::npos; at = l.find(mem, at + 1)) {
      // "内存一直升高，直到程序崩溃" (RAM keeps rising until the program crashes): a crash
      // (崩溃/崩了/挂了) ends the growth as an overflow does, a clause further on.
      std::string_view rest = l.substr(at + mem.size(), 45);
      for (std::string_view end : {std::string_view("溢出"), std::string_view("崩溃"), std::string_view("崩了"),
                                   std::string_view("挂了")}) {
        const size_t o = rest.find(end);
        if (o == std::string_view::npos || (end == "溢出" && o > 30)) continue;
        if (!ContainsAny(rest.substr(0, o), {"涨", "增", "升", "长"})) continue;
        if (!ChineseNegatedJustBefore(rest, o)) return true;
      }
    }
  }
  return false;
}

// "the Colab runtime crashes saying that it crashed due to low RAM", "runtime crashes due to low
// RAM": a crash or a kill put down to low memory. The failure word comes first, not negated in
// the dozen characters before it ("it won't crash due to low memory"), and not in a condition;
// low memory without a failure ("runs slowly due to low RAM") stays quiet.
bool FailureDueToLowMemory(std::string_view l) {
  for (std::string_view cause : {std::string_view("due to low "), std::string_view("because of low ")}) {
    for (size_t at = l.find(cause); at != std::string_view::npos; at = l.find(cause, at + 1)) {
      // The memory word right after "low", or one word on ("low system memory"); not further
      // ("low disk space on the memory card").
      std::string_view rest = l.substr(at + cause.size());
      const size_t first = rest.find(' ');
      const size_t second = first == std::string_view::npos ? first : rest.find(' ', first + 1);
      if (!MemoryWithinWords(rest.substr(0, second))) continue;
      std::string_view before = l.substr(0, at);
      size_t fail = std::string_view::npos;
      for (std::string_view w : {"crash", "kill", "died", "dies", "abort", "terminat"})
        if (size_t f = before.rfind(w); f != std::string_view::npos && (fail == std::string_view::npos || f > fail))
          fail = f;
      if (fail == std::string_view::npos || Conditional(before)) continue;
      if (DeniedJustBefore(before, fail)) continue;
      return true;
    }
  }
  return false;
}

// "# Why does the model quantization prompt KILLED at the end?": the shell's "Killed" shouted in a
// sentence (case kept: `t` is the line as written). The word before it is a lower-case word of
// the sentence, not a state's name ("Final State: KILLED", "status=KILLED", "the job state is KILLED"),
// nor a denial ("was not KILLED") or a condition ("if it is KILLED").
bool ShoutedKilled(std::string_view t) {
  for (size_t at = t.find("KILLED"); at != std::string_view::npos; at = t.find("KILLED", at + 1)) {
    if (at + 6 < t.size() && std::isalpha(static_cast<unsigned char>(t[at + 6]))) continue;
    if (at < 2 || t[at - 1] != ' ') continue;
    size_t b = at - 1;
    while (b > 0 && std::islower(static_cast<unsigned char>(t[b - 1]))) --b;
    if (b == at - 1 || (b > 0 && std::isalpha(static_cast<unsigned char>(t[b - 1])))) continue;
    const std::string before = Lower(t.substr(0, at));
    std::string_view word = t.substr(b, at - 1 - b);
    if (word == "not" || word == "never" || Conditional(before) ||
        ContainsAny(before, {"state", "status", "n't ", " not ", "never "}))
      continue;
    return true;
  }
  return false;
}

// A kill someone ordered, in a line that says nothing of memory: "The job
// state is KILLED by the user.", "the run was killed manually".
bool KilledOnPurpose(std::string_view l) {
  return ContainsAny(l, {"killed by the user", "killed by user", "killed by me", "killed by an admin",
                         "killed by the admin", "killed manually", "manually killed", "state is killed",
                         "status is killed"}) &&
         !ContainsAny(l, {"memory", "内存", "显存"}) && !HasWord(l, "oom") && !HasWord(l, "ram");
}

// A sentence about an OOM (used only when no error record exists).
bool Mention(std::string_view l) {
  if (KilledOnPurpose(l)) return false;
  if (ContainsAny(l, {"out of memory", "out-of-memory", "out-of-gpu-memory", "out of gpu memory", "outofmemory",
                      "over memory", "`killed`", "memory error", "get killed", "gets killed", "got killed",
                      "getting killed", "being killed", "been killed", "was killed", "is killed", "process killed",
                      "killed by the system", "killed by system", "killed by linux", "oom killer",
                      // OOMs described in words rather than printed ("CUDA of out memory" is a real title).
                      "of out memory", "out of vram", "memory explode", "memory exploding", "memory blows up",
                      "memory blow up", "memory leak", "leaks memory", "leaking memory", "runs out of ram",
                      // "训练的时候存在内存泄露" (a memory leak while training), both spellings of 泄漏.
                      "内存泄露", "内存泄漏", "显存泄露", "显存泄漏",
                      "ran out of ram", "until oom", "\"killed\"", "显存不足", "显存不够", "显存溢出", "爆显存",
                      "内存不足", "内存不够", "内存溢出", "메모리 부족", "memory surge", "memory issue",
                      "rising of gpu memory", "continuous rising", "blows up", "cublas initialization",
                      // Notebook runtimes: "Your session crashed after using all available RAM".
                      "all available ram", "all available memory", "all the available memory",
                      // "which leads to the memory is out", "GPU memory ran out"
                      "memory is out", "memory ran out", "memory runs out", "memory run out", "memory running out",
                      // Hugging Face datasets' report of a map() worker the kernel killed.
                      "subprocesses has abruptly died",
                      // "Increase batch size causes Cudamalloc error"
                      "cudamalloc error", "cuda malloc error", "cudamalloc failed",
                      // A title naming the shell's kill: "# Killed error".
                      "killed error",
                      // "causing `cuda:0` memory to explode", "显存爆炸" (memory explosion).
                      "memory to explode", "memory explosion", "显存爆炸", "内存爆炸", "显存炸",
                      // "溢出显存" (overflows the GPU memory), "爆内存" (RAM blown).
                      "溢出显存", "溢出内存", "爆内存",
                      // "will drain memory easily", "exhaust memory", "crashes due to lack of memory",
                      // "the program will get kill", a Colab kill named "C^ error".
                      "drain memory", "drains memory", "draining memory", "drain the memory", "exhaust memory",
                      "exhausts memory", "exhausting memory", "exhaust the memory", "lack of memory", "lack of ram",
                      "lack of gpu memory", "lack of vram", "not enough ram", "get kill", "gets kill", "got kill",
                      "c^ error", "^c error",
                      // PyTorch's CPU allocator named as the error: "causing a DefaultCPUAllocator-Error later on".
                      "defaultcpuallocator-error", "defaultcpuallocator error",
                      // A title naming the card's memory: "# Insufficient graphics memory for this model!".
                      "insufficient graphics memory", "insufficient video memory", "insufficient vram"}))
    return true;
  if (ChineseMemoryGrowsToOverflow(l) || FailureDueToLowMemory(l)) return true;
  if (ChineseMemoryBurst(l) || KilledAfterAdverb(l) || MemoryOutAtEnd(l) || ChinesePassiveKill(l) ||
      KilledInChinese(l) || RanOutAfterMemory(l))
    return true;
  // "# When reproducing, the CPU memory explores": "explodes" misspelt. The real verb takes an
  // object ("the agent's memory explores the state space"), so only where it ends the line.
  for (size_t at = l.find("memory explores"); at != std::string_view::npos; at = l.find("memory explores", at + 1))
    if (RestOfLine(l, at + 15).empty()) return true;
  // "it returned me error that I have not enough memory on my GPU", "not enough GPU memory";
  // not a condition ("if there is not enough memory on the GPU, it falls back to the CPU").
  for (std::string_view phrase : {std::string_view("not enough memory on "), std::string_view("not enough gpu memory"),
                                  std::string_view("not enough vram"), std::string_view("not enough video memory"),
                                  std::string_view("not enough cuda memory")}) {
    size_t at = l.find(phrase);
    if (at == std::string_view::npos || Conditional(l.substr(0, at))) continue;
    if (phrase != "not enough memory on " ||
        ContainsAny(l.substr(at + phrase.size(), 20), {"gpu", "card", "graphics", "device", "cuda"}))
      return true;
  }
  // Memory used up until none is left: "the cpu ram is consumed until it depletes thus silently
  // killing the process", "CPU RAM consumption until depletion".
  if (size_t at = l.find("until"); at != std::string_view::npos && MemoryWord(l.substr(0, at)) &&
                                    Contains(l.substr(at, 30), "deplet"))
    return true;
  // Memory filled until the machine failed: "it fills up shuffle buffer which also fills up RAM memory so
  // if the data is huge and RAM is not enough then it hangs up the system which leads to system restart".
  if (ContainsAny(l, {"fills up", "filled up", "fill up", "filling up"}) && MemoryWord(l) &&
      ContainsAny(l, {" hangs", " hang up", " hung", "freez", "restart", "crash"}))
    return true;
  // A progress bar cut by a notebook's kill: "Loading checkpoint shards: 0% 0/2 [00:00<?, ?it/s]^C"
  // (Colab prints ^C when its runtime kills the process for RAM).
  if (size_t at = l.find("]^c"); at != std::string_view::npos && Contains(l.substr(0, at), "/")) return true;
  // "为什么会out memory": "out memory" as words (not the end of "without memory").
  for (size_t at = l.find("out memory"); at != std::string_view::npos; at = l.find("out memory", at + 1))
    if (at == 0 || !std::isalpha(static_cast<unsigned char>(l[at - 1]))) return true;
  // "it will try to allocate 28MB and fail", "Cannot malloc 49 MB GPU memory"
  if (size_t at = l.find("allocate"); at != std::string_view::npos && Contains(l.substr(at), " fail")) return true;
  for (std::string_view verb : {"cannot allocate", "can't allocate", "cannot malloc", "failed to allocate",
                                 "failure to allocate", "unable to allocate", "could not allocate"}) {
    size_t at = l.find(verb);
    if (at == std::string_view::npos) continue;
    // "... memory", a size ("alloc failure to allocate ~286GB"), or a library's
    // scratch memory ("If we can't allocate the workspace for the desired algorithm").
    std::string_view rest = l.substr(at + verb.size());
    if (ContainsAny(rest, {"memory", "workspace"}) || HasSize(rest.substr(0, 40))) return true;
  }
  // "storing ... quickly eats up memory and kills the job": memory taken until the process died.
  if (ContainsAny(l, {"eats up", "eating up", "eat up", "ate up", "eats all", "eating all"}) &&
      ContainsAny(l, {"memory", " ram"}) && ContainsAny(l, {"kill", "crash"}))
    return true;
  // Shared memory exhausted in a container: "Bus error / No space left on device due to
  // Docker's default /dev/shm limit".
  // "bus error，insufficient shared memery (shm)": the marker's words misspelt, and "(shm)".
  if (ContainsAny(l, {"bus error", "no space left on device"}) && ContainsAny(l, {"/dev/shm", "shared mem", "(shm)", " shm"}))
    return true;
  // "I crash the memory of my GPUs", "Batch size changes for memory crashing"
  if (ContainsAny(l, {"crash the memory", "crashing the memory", "crashes the memory", "memory crashing",
                      "memory crash"}))
    return true;
  // "run out of my cuda memory", "out of GPU RAM", "still out of memories": "out of" and a memory word
  // at most three words later.
  // "Ran of GPU memory" (a title that lost its "out") reads the same way.
  for (size_t at = l.find(" of "); at != std::string_view::npos; at = l.find(" of ", at + 1)) {
    if (!(at >= 3 && l.substr(at - 3, 3) == "out") &&
        !(at >= 3 && l.substr(at - 3, 3) == "ran" && (at == 3 || !std::isalpha(static_cast<unsigned char>(l[at - 4])))))
      continue;
    if (MemoryWithinWords(l.substr(at + 4))) return true;
  }
  // "# CUDA outof memory": "out of" run together (as a word, not the end of "withoutof").
  for (size_t at = l.find("outof "); at != std::string_view::npos; at = l.find("outof ", at + 1))
    if ((at == 0 || !std::isalpha(static_cast<unsigned char>(l[at - 1]))) && MemoryWithinWords(l.substr(at + 6)))
      return true;
  // A notebook's crash in the reporter's own words, misspelt: "Colab crashes after using all avilable RAM".
  if (size_t at = l.find("after using all"); at != std::string_view::npos) {
    std::string_view rest = l.substr(at + 15, 30);
    if (ContainsAny(rest, {"ram", "memory"})) return true;
  }
  // A memory limit reached: "the max RAM memory is reached", "hits the maximum GPU memory".
  if (ContainsAny(l, {"max", "limit"}) && ContainsAny(l, {"ram", "memory"}) &&
      ContainsAny(l, {"is reached", "was reached", "gets reached", "got reached"}))
    return true;
  // All of a memory taken, then a crash or a kill: "keeps taking up all the 12 GB RAM and then crashes".
  for (size_t at = l.find("all the "); at != std::string_view::npos; at = l.find("all the ", at + 1)) {
    std::string_view rest = l.substr(at + 8, 24);
    if (ContainsAny(rest, {"ram", "memory"}) && ContainsAny(l.substr(at), {"crash", "kill"})) return true;
  }
  // "It runs until the RAM is full."
  if (ContainsAny(l, {"until the ram is full", "until ram is full", "until the memory is full", "until memory is full",
                      "until the vram is full", "until vram is full", "until the gpu memory is full"}))
    return true;
  // "It causes the memory to exceed its limit"
  if (Contains(l, "memory") && ContainsAny(l, {"exceed its limit", "exceeds its limit", "exceeded its limit",
                                               "exceed the limit", "exceeds the limit", "exceeded the limit"}))
    return true;
  // "fails due to cuda memory limit", "exceeds the GPU memory limit"
  if (size_t at = l.find("memory limit"); at != std::string_view::npos &&
      ContainsAny(l, {"fail", "exceed", "hit the", "hits the", "reach", "over the"}))
    return true;
  // Memory that filled up and crashed the machine: "beyond 16 gb which is the max. RAM that I have hence
  // system crashes".
  if (ContainsAny(l, {"crash"}) && ContainsAny(l, {" ram ", " ram.", "memory"}) &&
      ContainsAny(l, {"increas", "grow", "full", "the max", "maximum"}))
    return true;
  // "uses all the GPU memory ... causes a crash as soon as ..."
  if (ContainsAny(l, {"all the gpu memory", "all gpu memory", "all of the gpu memory", "all the memory",
                      "all of the memory", "all the vram"}) &&
      ContainsAny(l, {"crash", "fail", "error"}))
    return true;
  // "OOM", and the verb: "ooms", "OOMed", "OOMing", "OOM'd".
  for (size_t at = l.find("oom"); at != std::string_view::npos; at = l.find("oom", at + 1)) {
    bool left = at == 0 || !std::isalpha(static_cast<unsigned char>(l[at - 1]));
    std::string_view tail = l.substr(at + 3);
    size_t n = 0;
    while (n < tail.size() && std::isalpha(static_cast<unsigned char>(tail[n]))) ++n;
    std::string_view suffix = tail.substr(0, n);
    if (left && (suffix.empty() || suffix == "s" || suffix == "ed" || suffix == "ing" || tail.starts_with("'d")))
      return true;
  }
  return false;
}

bool IsProgress(std::string_view l) {
  return (Contains(l, "%|") || ContainsAny(l, {"epoch", " step ", "step:", "step=", "iter ", "iter:", "iteration"})) &&
         !ContainsAny(l, {"out of memory", "file \"", "tried to allocate", "killed"});
}

// The same failure printed twice (quoted in a sentence, then in its
// traceback): the same text, or the same figures.
bool SameFailure(std::string_view a, std::string_view b) {
  auto core = [](std::string_view s) {
    std::string out;
    for (char c : s)
      if (std::isalnum(static_cast<unsigned char>(c))) out.push_back(static_cast<char>(std::tolower(c)));
    return out;
  };
  std::string ca = core(a), cb = core(b);
  if (!ca.empty() && (Contains(ca, cb) || Contains(cb, ca))) return true;
  internal::OomFigures fa = internal::ParseOomFigures(a), fb = internal::ParseOomFigures(b);
  return fa.requested && fa.requested == fb.requested && fa.capacity == fb.capacity && fa.allocated == fb.allocated;
}

struct Event {
  size_t first = 0, last = 0, anchor = 0;  // line indices
  OomKind kind = OomKind::kNone;
  int rank = -1;
  std::string host;
  int figures = -1;  // figures the anchor line's message holds
  int record = -1;   // how much the anchor line looks like an error record (RecordScore)
  bool mention = false;
};

// An error record rather than a sentence quoting one: it starts with an
// exception or the failure itself, or sits right under a traceback.
int RecordScore(const std::vector<Line>& lines, size_t i) {
  const std::string& l = lines[i].lower;
  int score = 0;
  size_t colon = l.find(": ");
  if (colon != std::string::npos && colon < 60 && l.find(' ') >= colon) score += 1;  // "RuntimeError: ..."
  for (size_t k = i; k > 0 && k + 3 > i; --k)
    if (Contains(lines[k - 1].lower, "file \"") || Contains(lines[k - 1].raw, "    ")) {
      score += 1;
      break;
    }
  return score;
}

int FigureCount(const internal::OomFigures& f) {
  return (f.requested ? 1 : 0) + (f.capacity ? 1 : 0) + (f.free ? 1 : 0) + (f.allocated ? 1 : 0) +
         (f.reserved ? 1 : 0) + (f.process_in_use ? 1 : 0) + static_cast<int>(f.other_processes.size());
}

// The OOM line plus the lines that continue it: a message wrapped by a
// console, TensorFlow's "[[Node: ...]]" and hint, XLA's buffer statistics.
// `floor`: the first line after the previous event.
std::string MessageOf(const std::vector<Line>& lines, const Event& e, size_t floor) {
  std::string msg = lines[e.anchor].stripped;
  for (size_t i = e.anchor + 1; i < lines.size() && i <= e.anchor + 12 && msg.size() < kMaxMessage; ++i) {
    const Line& l = lines[i];
    if (l.stripped.empty() || IsProgress(l.lower) || ContainsAny(l.lower, {"traceback (most recent", "file \""}))
      break;
    bool continues = ContainsAny(l.lower, {"total capacity", "total capacty", "already allocated", "reserved", "free;",
                                           "[[node", "[[{{node", "hint:", "bufferassignment", "allocation:",
                                           "fragmentation:", "gpu ", "npu ", "including non-pytorch", "process ",
                                           "memory management", "of the allocated"});
    if (!continues) break;
    msg += "\n" + l.stripped;
  }
  // TensorFlow prints its allocator's limits before the error.
  for (size_t i = std::max(floor, e.first > 20 ? e.first - 20 : 0); i < e.anchor && msg.size() < kMaxMessage; ++i) {
    const std::string& l = lines[i].lower;
    if (ContainsAny(l, {"limit:", "inuse:"}) && !Contains(msg, lines[i].stripped)) msg += "\n" + lines[i].stripped;
  }
  if (msg.size() > kMaxMessage) msg.resize(kMaxMessage);
  return msg;
}

std::string ExceptionType(std::string_view msg, const internal::OomFigures& fig) {
  // "torch.cuda.OutOfMemoryError: ...", "RuntimeError: ...": the word before the first ": ".
  size_t colon = msg.find(": ");
  if (colon != std::string_view::npos && colon < 80) {
    std::string_view head = msg.substr(0, colon);
    size_t b = head.find_last_of(" \t(`'\"");
    std::string_view name = b == std::string_view::npos ? head : head.substr(b + 1);
    if (name.ends_with("Error") || name.ends_with("Exception")) return std::string(name);
  }
  const std::string l = Lower(msg);
  if (Contains(l, "oomkilled")) return "Kubernetes OOMKilled";
  if (ContainsAny(l, {"oom_kill event", "oom-kill event"})) return "Slurm oom_kill";
  if (!fig.format.empty()) return fig.format;
  if (ContainsAny(l, {"sigkill", "exit code 137", "killed"})) return "SIGKILL";
  return "";
}

// "2024-04-29T14:55:41" / "2021-06-02 15:50:53" at the start of a line, as UTC.
int64_t Timestamp(std::string_view raw) {
  std::string_view t = Trim(raw);
  if (t.size() > 0 && t[0] == '[') t.remove_prefix(1);
  if (t.size() < 19) return 0;
  int y, mo, d, h, mi, s;
  char sep;
  std::string head(t.substr(0, 19));
  if (std::sscanf(head.c_str(), "%4d-%2d-%2d%c%2d:%2d:%2d", &y, &mo, &d, &sep, &h, &mi, &s) != 7) return 0;
  if ((sep != ' ' && sep != 'T') || y < 1990 || mo < 1 || mo > 12 || d < 1 || d > 31) return 0;
  std::tm tm{};
  tm.tm_year = y - 1900;
  tm.tm_mon = mo - 1;
  tm.tm_mday = d;
  tm.tm_hour = h;
  tm.tm_min = mi;
  tm.tm_sec = s;
  return static_cast<int64_t>(timegm(&tm)) * 1000;
}

std::string Hex16(uint64_t h) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, h);
  return buf;
}

std::vector<Event> FindEvents(const std::vector<Line>& lines) {
  std::vector<Event> events;
  for (size_t i = 0; i < lines.size(); ++i) {
    const Line& l = lines[i];
    OomKind kind = OomKind::kNone;
    if (BareKill(l.lower)) {
      kind = OomKind::kHost;
    } else if (FormatMarker(l.lower)) {
      kind = ClassifyMessage(l.stripped).kind;
    }
    if (kind == OomKind::kNone) continue;
    const int figures = FigureCount(internal::ParseOomFigures(l.stripped));
    const int record = RecordScore(lines, i);
    if (!events.empty()) {
      Event& e = events.back();
      bool progress_between = false, new_traceback = false;
      for (size_t k = e.last + 1; k < i; ++k) {
        progress_between |= IsProgress(lines[k].lower);
        if (Contains(lines[k].lower, "traceback (most recent call last)")) {
          bool chained = false;
          for (size_t j = k > 4 ? k - 4 : 0; j < k; ++j)
            chained |= ContainsAny(lines[j].lower, {"during handling of the above", "direct cause of the following"});
          // A sentence quoting the error (a report's first line) does not
          // own an event that the traceback below it would contradict.
          new_traceback |= !chained && !SameFailure(lines[e.anchor].stripped, l.stripped) && e.record > 0;
        }
      }
      bool same_rank = e.rank < 0 || l.rank < 0 || e.rank == l.rank;
      bool same_family = (e.kind == OomKind::kHost) == (kind == OomKind::kHost);
      if (same_rank && same_family && !progress_between && !new_traceback && i - e.last <= 60) {
        e.last = i;
        // The most informative line speaks for the event; a workspace
        // failure is more specific than the device OOM it causes.
        if (figures > e.figures || (figures == e.figures && record > e.record) ||
            (kind == OomKind::kWorkspace && e.kind != OomKind::kWorkspace)) {
          e.anchor = i;
          e.figures = figures;
          e.record = record;
          if (kind == OomKind::kWorkspace || e.kind != OomKind::kWorkspace) e.kind = kind;
        }
        if (e.rank < 0) e.rank = l.rank;
        if (e.host.empty()) e.host = l.host;
        continue;
      }
    }
    Event e;
    e.first = e.last = e.anchor = i;
    e.kind = kind;
    e.rank = l.rank;
    e.host = l.host;
    e.figures = figures;
    e.record = record;
    events.push_back(e);
  }
  if (!events.empty()) return events;
  // No error record: a description of an OOM is one event at its first mention.
  // TensorFlow warns "Allocation of N exceeds 10% of free system memory" as
  // host memory fills; a process then reported killed was the kernel's OOM kill.
  bool system_memory_warned = false;
  for (const Line& l : lines) system_memory_warned = system_memory_warned || Contains(l.lower, "% of system memory") ||
                                                     Contains(l.lower, "% of free system memory");
  for (size_t i = 0; i < lines.size(); ++i) {
    if (!Mention(lines[i].lower) && !ShoutedKilled(lines[i].stripped) &&
        !(system_memory_warned && HasWord(lines[i].lower, "killed")))
      continue;
    Event e;
    e.first = e.last = e.anchor = i;
    e.mention = true;
    e.rank = lines[i].rank;
    std::string all;
    for (const Line& l : lines) all += l.lower + "\n";
    // A process said to be killed, or its resident/system memory, is host
    // memory even in a GPU job, unless the device's own OOM is named.
    const bool device_oom = ContainsAny(all, {"cuda out of memory", "cuda error: out of memory", "gpu out of memory",
                                              "out of gpu memory", "out-of-gpu-memory", "vram", "显存", "cuda oom"});
    bool host = ContainsAny(all, {"killed", "kills the", " rss", "system memory", "cpu memory", "host memory", "内存",
                                  "num_workers", "abruptly died", "/dev/shm", "bus error", "defaultcpuallocator"});
    host = host || HasWord(all, "ram") || HasWord(all, "kill");  // "RAM", not "program"; "it always kill"
    const bool device = ContainsAny(all, {"cuda", "gpu", "npu"});
    e.kind = device_oom || (device && !host) ? OomKind::kDevice : (host ? OomKind::kHost : OomKind::kDevice);
    events.push_back(e);
    break;
  }
  return events;
}

}  // namespace

StatusOr<std::vector<Incident>> ParseOomLog(std::string_view text, const LogParseOptions& options) {
  const std::string name = options.source_name.empty() ? "input" : options.source_name;
  if (text.size() > kMaxText)
    return Status::InvalidArgument(name + ": " + std::to_string(text.size() >> 20) +
                                   " MiB is larger than the 256 MiB a log may have");
  if (text.substr(0, 64 * 1024).find('\0') != std::string_view::npos)
    return Status::InvalidArgument(name + ": not a text log (it holds NUL bytes)");
  std::vector<std::string> raw;
  text::SplitClean(text, &raw);
  std::vector<Line> lines(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    Line& l = lines[i];
    l.raw = std::move(raw[i]);
    l.stripped = std::string(Trim(StripLinePrefix(l.raw, &l.rank, &l.host)));
    l.lower = Lower(l.stripped);
  }
  std::vector<Event> events = FindEvents(lines);
  if (events.size() > options.max_events)
    return Status::InvalidArgument(name + ": " + std::to_string(events.size()) + " OOM events is more than the " +
                                   std::to_string(options.max_events) + " a log may have");

  std::vector<Incident> out;
  std::optional<int64_t> previous_step;
  for (size_t k = 0; k < events.size(); ++k) {
    const Event& e = events[k];
    const size_t lo_bound = k > 0 ? events[k - 1].last + 1 : 0;
    const size_t before = static_cast<size_t>(std::max(0, options.context_lines_before));
    size_t lo = std::max(lo_bound, e.anchor > before ? e.anchor - before : 0);
    // A text with one OOM is a report or a short log: what follows the error
    // (the traceback pasted below it, the description) belongs to it.
    const size_t after = events.size() == 1 ? 100 : static_cast<size_t>(std::max(0, options.context_lines_after));
    size_t hi = std::min(lines.size(), e.last + 1 + after);
    if (k + 1 < events.size()) hi = std::min(hi, events[k + 1].first);
    std::string context;
    for (size_t i = lo; i < hi; ++i) context += lines[i].raw + "\n";
    if (context.size() > kMaxContext) context = context.substr(context.size() - kMaxContext);

    Incident inc;
    inc.message = e.mention ? lines[e.anchor].stripped : MessageOf(lines, e, lo_bound);
    inc.context = std::move(context);
    inc.source = name + ":" + std::to_string(e.anchor + 1);
    inc.run_id = options.run_id.empty() ? name : options.run_id;
    inc.workload = options.workload;
    inc.kind = internal::IncidentKindOf(e.kind);
    const internal::OomFigures fig = internal::ParseOomFigures(inc.message);
    inc.exception_type = ExceptionType(inc.message, fig);
    inc.requested_bytes = fig.requested.value_or(0);
    if (fig.capacity && fig.free) {
      inc.memory.total = *fig.capacity;
      inc.memory.free = *fig.free;
    }
    inc.memory.allocated = fig.allocated.value_or(0);
    inc.memory.reserved = fig.reserved.value_or(0);
    inc.host = e.host;
    for (size_t i = e.anchor + 1; inc.host.empty() && i-- > lo;) inc.host = lines[i].host;
    if (e.rank >= 0) inc.rank = e.rank;
    else inc.unknown.push_back("rank");
    const TextCues cues = AnalyzeText(inc.context, inc.message);
    // The text cues name phases of the incident vocabulary (incident.h).
    inc.phase = ParsePhase(cues.phase).value_or(Phase::kUnknown);
    // Evaluation is where it ran; its forward pass is what it ran.
    if (cues.eval && (cues.phase.empty() || cues.phase == "forward")) inc.phase = Phase::kEval;
    if (cues.first_step) {
      inc.step = 0;
      inc.steps_ok_before = 0;
    } else if (cues.step) {
      inc.step = *cues.step;
      // Within one log, clean steps count from the previous OOM.
      int64_t done = cues.steps_done.value_or(*cues.step);
      inc.steps_ok_before = previous_step && *previous_step <= done ? done - *previous_step : done;
    } else {
      inc.unknown.push_back("step");
      inc.unknown.push_back("steps_ok_before");
    }
    if (cues.step) previous_step = cues.step;
    inc.time_unix_ms = options.default_time_unix_ms;
    for (size_t i = e.anchor + 1; i-- > lo;) {
      if (int64_t t = Timestamp(lines[i].raw)) {
        inc.time_unix_ms = t;
        break;
      }
    }
    // Same text at the same line: the same id, so a second import replaces.
    std::string key = std::to_string(e.anchor) + "\n" + inc.message + "\n" + inc.context;
    inc.id = Hex16(XXH3_64bits(key.data(), key.size()));
    out.push_back(std::move(inc));
  }
  return out;
}

}  // namespace oomguard::kb
