// Descriptions: what a person reporting an OOM wrote in plain words ("memory
// keeps increasing", "after 15K steps", "during validation", "when I resume
// from a checkpoint"). These cues weigh less than figures or frames; the
// classifier says when a conclusion rests on them.
#include <array>
#include <cctype>

#include "sdk/kb/text_scan.h"

namespace oomguard::kb {
namespace {

using text::Contains;
using text::ContainsAny;

// A negation shortly before `at` ("no other process", "not during ..."),
// as whole words ("whenever" is not "never").
bool Negated(std::string_view all, size_t at) {
  size_t from = at > 24 ? at - 24 : 0;
  std::string_view before = all.substr(from, at - from);
  size_t i = 0;
  while (i < before.size()) {
    while (i < before.size() && !std::isalpha(static_cast<unsigned char>(before[i])) && before[i] != '\'') ++i;
    size_t b = i;
    while (i < before.size() && (std::isalpha(static_cast<unsigned char>(before[i])) || before[i] == '\'')) ++i;
    std::string_view w = before.substr(b, i - b);
    if (b == 0 && from > 0) continue;  // a word cut by the window
    if (w == "no" || w == "not" || w == "never" || w == "without" || w.ends_with("n't")) return true;
  }
  return false;
}

// A guess, not an observation ("maybe some library causes a memory leak").
bool Hedged(std::string_view all, size_t at) {
  size_t from = at > 40 ? at - 40 : 0;
  std::string_view before = all.substr(from, at - from);
  if (size_t stop = before.find_last_of(".!?\n"); stop != std::string_view::npos) before = before.substr(stop + 1);
  return ContainsAny(before, {"maybe", "might", "perhaps", "possibly", "probably", "i guess", "i wonder",
                              "i think", "i suspect", "could it be", "is it ", "whether", "as though", "as if"});
}

// The text as written, for quotes. Set by ReadDescription for its duration:
// the cue readers search the lower-cased text, and threading the original
// through every one of them would double their parameters for one use.
thread_local std::string_view tl_lower;
thread_local std::string_view tl_written;

// Which three-byte sequences the text being read holds, hashed into 64K
// bits. A phrase with a trigram the text lacks cannot occur in it, so most
// of the hundreds of phrases looked for are ruled out without scanning the
// text (the scans were most of a report's classification time). Built by
// ReadDescription for tl_lower; a phrase shorter than three bytes always passes.
class TrigramFilter {
 public:
  void Build(std::string_view s) {
    bits_.fill(0);
    for (size_t i = 0; i + 3 <= s.size(); ++i) {
      const uint32_t h = Hash(s[i], s[i + 1], s[i + 2]);
      bits_[h >> 6] |= uint64_t{1} << (h & 63);
    }
  }
  bool MayContain(std::string_view p) const {
    for (size_t i = 0; i + 3 <= p.size(); ++i) {
      const uint32_t h = Hash(p[i], p[i + 1], p[i + 2]);
      if ((bits_[h >> 6] & (uint64_t{1} << (h & 63))) == 0) return false;
    }
    return true;
  }

 private:
  static uint32_t Hash(char a, char b, char c) {
    const uint32_t x = static_cast<unsigned char>(a) | static_cast<unsigned char>(b) << 8 |
                       static_cast<unsigned char>(c) << 16;
    return (x * 0x9E3779B1u) >> 16;
  }
  std::array<uint64_t, 1024> bits_{};
};
thread_local TrigramFilter tl_trigrams;

// False when `phrase` cannot occur in `all` (the text ReadDescription reads).
bool MayHold(std::string_view all, std::string_view phrase) {
  return all.data() != tl_lower.data() || all.size() != tl_lower.size() || tl_trigrams.MayContain(phrase);
}

// `all` quoted around [at, at + len), in the case it was written in when
// `all` is the text ReadDescription is reading.
std::string Snippet(std::string_view all, size_t at, size_t len) {
  if (all.data() == tl_lower.data() && all.size() == tl_written.size()) all = tl_written;
  size_t b = all.rfind('\n', at);
  b = b == std::string_view::npos ? 0 : b + 1;
  if (at > b + 40) b = all.find(' ', at - 40) + 1;
  size_t e = all.find('\n', at);
  if (e == std::string_view::npos) e = all.size();
  if (e > at + len + 40) {
    size_t cut = all.rfind(' ', at + len + 40);
    e = cut != std::string_view::npos && cut > at + len ? cut : at + len + 40;
  }
  return "\"" + std::string(text::Trim(all.substr(b, e - b))) + "\"";
}

// The first phrase of `phrases` found (not negated); sets the cue with a quote.
bool Said(std::string_view all, std::initializer_list<std::string_view> phrases, Cue* cue) {
  for (std::string_view p : phrases) {
    if (!MayHold(all, p)) continue;
    for (size_t at = all.find(p); at != std::string_view::npos; at = all.find(p, at + 1)) {
      if (Negated(all, at) || Hedged(all, at)) continue;
      cue->Set("the report says " + Snippet(all, at, p.size()));
      return true;
    }
  }
  return false;
}

// A word that is not part of an identifier or a flag ("--do_eval",
// "validation_file", "eval_batch_size" are configuration, not events).
bool SaidWord(std::string_view all, std::initializer_list<std::string_view> stems, Cue* cue) {
  for (std::string_view stem : stems) {
    if (!MayHold(all, stem)) continue;
    for (size_t at = all.find(stem); at != std::string_view::npos; at = all.find(stem, at + 1)) {
      char before = at > 0 ? all[at - 1] : ' ';
      size_t end = at + stem.size();
      while (end < all.size() && std::isalpha(static_cast<unsigned char>(all[end]))) ++end;
      char after = end < all.size() ? all[end] : ' ';
      if (before == '_' || before == '-' || before == '.' || before == '/' || std::isalnum(static_cast<unsigned char>(before)))
        continue;
      if (after == '_' || after == '=' || after == '.' || after == '/') continue;
      if (Negated(all, at)) continue;
      cue->Set("the report says " + Snippet(all, at, end - at));
      return true;
    }
  }
  return false;
}

std::optional<int64_t> QuantityWord(std::string_view w) {
  struct Q {
    std::string_view word;
    int64_t value;
  };
  static constexpr Q kWords[] = {{"one", 1},   {"two", 2},       {"three", 3},     {"four", 4},     {"five", 5},
                                 {"six", 6},   {"seven", 7},     {"eight", 8},     {"nine", 9},     {"ten", 10},
                                 {"few", 3},   {"several", 3},   {"some", 2},      {"many", 10},    {"couple", 2},
                                 {"hundreds", 100}, {"hundred", 100}, {"thousands", 1000}, {"thousand", 1000},
                                 {"first", 1}, {"second", 2},    {"third", 3}};
  for (const Q& q : kWords)
    if (w == q.word) return q.value;
  if (auto n = text::NumberAt(w, 0)) {
    // Ordinals ("55th") count the epoch in progress: one fewer is done.
    return *n;
  }
  return std::nullopt;
}

// A verb near an object: "save(d|s|ing) ... checkpoint" within a few words,
// however the sentence is phrased ("attempts to save a checkpoint").
bool SaidNear(std::string_view all, std::initializer_list<std::string_view> verbs,
              std::initializer_list<std::string_view> objects, std::initializer_list<std::string_view> unless, Cue* cue) {
  for (std::string_view v : verbs) {
    if (!MayHold(all, v)) continue;
    for (size_t at = all.find(v); at != std::string_view::npos; at = all.find(v, at + 1)) {
      if (at > 0 && std::isalpha(static_cast<unsigned char>(all[at - 1]))) continue;
      std::string_view window = all.substr(at, 40);
      if (size_t nl = window.find('\n'); nl != std::string_view::npos) window = window.substr(0, nl);
      if (!ContainsAny(window, objects) || ContainsAny(window, unless) || Negated(all, at)) continue;
      cue->Set("the report says " + Snippet(all, at, window.size()));
      return true;
    }
  }
  return false;
}

// A failure named within a line's reach of `at` (60 bytes before, 40 after) and not denied
// ("does not run out of memory at epoch 5"): what makes "at epoch 5" or "in 100 epochs" the
// moment of the OOM rather than a plan.
bool FailureNear(std::string_view all, size_t at) {
  const size_t from = at > 60 ? at - 60 : 0;
  const std::string_view window = all.substr(from, at - from + 40);
  for (std::string_view w : {"out of memory", "oom", "memory error", "killed", "crash", "runs out", "ran out", "error"})
    for (size_t f = window.find(w); f != std::string_view::npos; f = window.find(w, f + 1))
      if (!Negated(all, from + f)) return true;
  return false;
}

// "after 15K training steps", "for 125 epochs", "before the 55th epoch",
// "after a few thousand of examples": how much ran before the OOM.
void ReadAmounts(std::string_view all, TextCues* c) {
  std::vector<std::string_view> words;
  std::vector<size_t> starts;
  for (size_t i = 0; i < all.size();) {
    while (i < all.size() && !std::isalnum(static_cast<unsigned char>(all[i])) && all[i] != '~') ++i;
    size_t b = i;
    while (i < all.size() && (std::isalnum(static_cast<unsigned char>(all[i])) || all[i] == '~' || all[i] == ',')) ++i;
    if (i > b) {
      std::string_view w = all.substr(b, i - b);
      while (!w.empty() && w.back() == ',') w.remove_suffix(1);
      words.push_back(w);
      starts.push_back(b);
    }
  }
  for (size_t k = 0; k < words.size(); ++k) {
    std::string_view u = words[k];
    bool epoch = u == "epoch" || u == "epochs";
    bool step = u == "step" || u == "steps" || u == "iteration" || u == "iterations" || u == "iters" ||
                u == "iter" || u == "batch" || u == "batches" || u == "examples" || u == "samples" ||
                u == "episodes" || u == "hours";
    if (!epoch && !step) continue;
    // "CUDA out of memory at epoch 5", "OOM happens at iteration 3000": the failure at a numbered
    // epoch or step, so the ones before it ran (epochs count from 1 as reports write them).
    if (k > 0 && k + 1 < words.size() && u != "examples" && u != "samples" && u != "episodes" && u != "hours") {
      std::string_view w = words[k - 1];
      auto n = text::NumberAt(words[k + 1], 0);
      if ((w == "at" || w == "in" || w == "during" || w == "around") && n && FailureNear(all, starts[k]) &&
          !Negated(all, starts[k])) {
        const int64_t done = epoch ? std::max<int64_t>(*n - 1, 0) : *n;
        std::optional<int64_t>& slot = epoch ? c->said_epochs_done : c->said_steps_done;
        if (!slot || done > *slot) slot = done;
        continue;
      }
    }
    std::optional<int64_t> amount;
    bool lead = false, before = false, ordinal = false;
    for (size_t back = 1; back <= 8 && back <= k; ++back) {
      std::string_view w = words[k - back];
      // "I got the out of memory in about 100 epochs": "in" an amount is history when the
      // failure was just named (not "it converges in 10 epochs").
      if (w == "after" || w == "past" || w == "than" || w == "over" ||
          (w == "in" && FailureNear(all, starts[k - back]))) {
        lead = true;
        break;
      }
      if (w == "for") {
        // "train for 10 epochs" is a plan; "runs fine for three steps" is history.
        for (size_t v = 1; v <= 4 && back + v <= k; ++v) {
          std::string_view verb = words[k - back - v];
          if (verb == "ran" || verb == "runs" || verb == "run" || verb == "running" || verb == "trained" ||
              verb == "training" || verb == "fine" || verb == "well" || verb == "normally" || verb == "worked" ||
              verb == "works" || verb == "successfully")
            lead = true;
        }
        break;
      }
      if (w == "before" || w == "until" || w == "till") {
        lead = before = true;
        break;
      }
      if (amount) continue;
      if (auto q = QuantityWord(w)) {
        amount = q;
        ordinal = w.size() > 2 && (w.substr(w.size() - 2) == "th" || w.substr(w.size() - 2) == "st" ||
                                   w.substr(w.size() - 2) == "nd" || w.substr(w.size() - 2) == "rd" ||
                                   w == "first" || w == "second" || w == "third");
      }
    }
    if (!lead || !amount || Negated(all, starts[k])) continue;
    int64_t done = *amount - ((ordinal && before) ? 1 : 0);
    if (u == "hours") done = std::max<int64_t>(done, 1) * 100;  // hours of training: many steps
    std::optional<int64_t>& slot = epoch ? c->said_epochs_done : c->said_steps_done;
    if (!slot || done > *slot) slot = done;
  }
}

}  // namespace

void ReadDescription(std::string_view all, std::string_view written, TextCues* c) {
  if (written.size() != all.size()) written = all;  // not the same text: quote lower-case
  if (all.size() > 64 * 1024) {
    all = all.substr(all.size() - 64 * 1024);
    written = written.substr(written.size() - 64 * 1024);
  }
  struct Scope {
    Scope(std::string_view l, std::string_view w) {
      tl_lower = l, tl_written = w;
      tl_trigrams.Build(l);
    }
    ~Scope() { tl_lower = {}, tl_written = {}; }
  } scope(all, written);
  Said(all, {"memory leak", "leaks memory", "leaking memory", "keeps increasing", "keep increasing", "kept increasing",
             "keeps growing", "keep growing", "grows slowly", "growed slowly", "grew slowly", "slowly increas",
             "steady increase", "steadily increas", "gradually increas", "gradually fill", "increases every",
             "increases each", "increasing every", "increase every", "increasing gpu-memory", "increasing gpu memory",
             "memory is increased", "more and more memory", "more and more gpu memory", "more and more vram",
             "memory usage keeps", "increasing during the training", "increasing during training", "not released",
             "added to a list", "appended to a list", "remain in the gpu", "remain in gpu", "stored on the gpu",
             "stored _on the gpu", "kept on the gpu", "only released", "accumulate memory", "accumulates memory",
             "accumulating memory", "memory accumulat", "grows unlimit", "grow unlimit", "ceaselessly grow",
             "continuously increas", "keeps rising", "keep rising", "continuous rising", "continuously rising",
             "grows until", "increases until", "increasing until", "rises until"},
       &c->said_growth);
  if (!c->said_growth)
    SaidNear(all, {"models in a", "model in a", "several models", "multiple models"}, {"loop"}, {}, &c->said_growth);
  Said(all, {"long sequence", "longer sequence", "long sentence", "long lines", "long input", "long utterance",
             "variable length", "varying length", "different length", "some batches", "certain batch",
             "particular batch", "specific batch", "the same step", "always stop at", "always stops at",
             "always fails at", "non-deterministic", "nondeterministic", "at a random", "random point", "randomly",
             "crop or limit", "truncate the", "limit the lines", "memory usage jumps", "memory jumps",
             "usage jumps", "sudden spike", "spikes in memory", "memory spike", "suddenly increase",
             "suddenly jumps", "skipping batch", "skip the batch", "skipped batch", "abnormal sample",
             "outlier sample", "some samples", "certain samples", "a few batches", "some long", "long examples",
             "long samples", "longer examples", "longer samples"},
       &c->said_batch_specific);
  SaidWord(all, {"validat", "evaluat", "eval stage", "eval phase", "eval mode", "eval loop", "test set", "testset",
                 "test data", "testing phase"},
           &c->said_eval);
  Said(all, {"without turning gradient", "without turning off gradient", "without disabling gradient",
             "without torch.no_grad", "without no_grad", "forgot torch.no_grad", "forgot no_grad",
             "forgot to use torch.no_grad", "not use torch.no_grad", "does not turn off gradients",
             "doesn't turn off gradients", "not turning off gradient", "gradients are still computed",
             "still computes gradients"},
       &c->said_grad_on);
  if (!SaidNear(all, {"resum", "restor", "reload", "restart", "continu"},
                {"checkpoint", "ckpt", "training", "state", "from disk"}, {"resume_from_checkpoint", "shards"},
                &c->said_resume))
    Said(all, {"existing checkpoint", "unfinished checkpoint", "after the checkpoint is loaded", "history loading",
               "load it from disk", "previous stored model", "loads the existing", "from a checkpoint",
               "from the checkpoint"},
         &c->said_resume);
  if (!Said(all, {"consolidat", "checkpoint saving", "when saving", "while saving", "after saving"}, &c->said_save))
    SaidNear(all, {"save", "saving", "saved"}, {"checkpoint", "ckpt", "state_dict", "state dict", "the model",
                                                "the state", "the weights", "the optimizer", "1st", "first"},
             {"save memory", "save gpu", "to save the memory"}, &c->said_save);
  // "after the first epoch" is progress, not the first step.
  for (std::string_view p : {"first iteration", "first step", "first batch", "first forward", "first training step",
                             "very first", "beginning of the training", "beginning of training", "start of training",
                             "can't even start", "cannot even start", "doesn't even start", "does not even start",
                             "fails immediately", "failed immediately", "instantly", "immediately", "right away",
                             "straight away", "at startup", "kick off training", "start training", "starting training",
                             "training starts", "start the training", "before training starts", "to begin the training", "begin the training",
                             "before the training starts", "training initialization", "state initialization",
                             "even with batch size 1", "even with `--batch_size 1", "even with --batch_size 1",
                             "even when batch_size=1", "batch_size to [1]", "batch_size=1, it"}) {
    size_t at = all.find(p);
    if (at == std::string_view::npos || Negated(all, at)) continue;
    if (at >= 10 && Contains(all.substr(at - 10, 10), "after")) continue;
    c->said_first.Set("the report says " + Snippet(all, at, p.size()));
    break;
  }
  ReadAmounts(all, c);
  // "even when I reduce the batch_size to 1", "batch size from 4 to 1", "batch设为1".
  for (size_t at = all.find("batch"); at != std::string_view::npos && !c->said_batch_one; at = all.find("batch", at + 1)) {
    std::string_view window = all.substr(at, 50);
    if (size_t nl = window.find('\n'); nl != std::string_view::npos) window = window.substr(0, nl);
    for (size_t k = 1; k + 1 <= window.size(); ++k) {
      if (window[k] != '1') continue;
      char before = window[k - 1];
      char after = k + 1 < window.size() ? window[k + 1] : ' ';
      if ((before == ' ' || before == '=' || before == ':' || before == '[' || static_cast<unsigned char>(before) > 127) &&
          !std::isdigit(static_cast<unsigned char>(after)) && after != '/' && after != ',' &&
          !(after == '.' && k + 2 < window.size() && std::isdigit(static_cast<unsigned char>(window[k + 2])))) {
        c->said_batch_one.Set("the report says " + Snippet(all, at, k + 1));
        break;
      }
    }
  }
  if (!SaidNear(all, {"load", "using", "use ", "with "}, {"pretrained weight", "pretrained model", "pre-trained weight",
                                                          "pretrained checkpoint"},
                {}, &c->said_pretrained))
    Said(all, {"pretrained weights", "pre-trained weights"}, &c->said_pretrained);
  if (!SaidNear(all, {"initializ", "initialis"}, {"model", "engine", "weights"}, {}, &c->said_model_to_device))
    Said(all, {"module.to(self.device", "model.to(device", "model.cuda()", "copied the model onto the gpu",
               "moving the model to", "move the model to", "loading the model onto"},
         &c->said_model_to_device);
  const bool gpu_word = ContainsAny(all, {"gpu 0", "gpu0", "gpu:0", "first gpu", "0 gpu", "main gpu", "master gpu",
                                          "gpu #0", "cuda:0", "first card", "one gpu", "other gpus"});
  if (gpu_word)
    Said(all, {"imbalanc", "unbalanc", "uneven", "more memory than", "more memories than", "much more memory",
               "only used in the first", "only on the first", "occupies much more", "takes more memory",
               "more than the others", "more than others", "only fails at one", "only on one gpu",
               "fails on one gpu", "basically empty", "others are empty", "other gpus are empty"},
         &c->said_imbalance);
  Said(all, {"another process", "other process", "other processes", "occupied by other", "someone else"},
       &c->said_other_process);
  Said(all, {"num_workers set to 0", "num_workers=0", "num_workers = 0", "num_workers 0", "num_workers to 0",
             "num_worker=0", "workers=0"},
       &c->said_no_workers);
  if (Contains(all, "adam") && Contains(all, "sgd"))
    c->said_adam_not_sgd.Set("the report compares Adam with SGD (Adam keeps two extra tensors per parameter)");
  if (!Said(all, {"loading checkpoint shards", "from_pretrained", "loading the model", "load the model",
                  "model loading", "loading model", "offload", "合并", "加载"},
            &c->said_loading_weights)) {
    for (size_t at = all.find("merg"); at != std::string_view::npos; at = all.find("merg", at + 1)) {
      std::string_view around = all.substr(at, 40);
      if (ContainsAny(around, {"lora", "weight", "model", "checkpoint"})) {
        c->said_loading_weights.Set("the report says " + Snippet(all, at, 5));
        break;
      }
    }
  }
  Said(all, {"dataloader", "data loader", "num_workers", "prefetch", "pin_memory", "shared memory", "/dev/shm",
             "replay_buffer", "replay buffer", "bus error", "preprocessing", "data-loading", "data loading",
             "loading data", "loading the dataset", "load the dataset", "dataset loading", "loading the data",
             // Datasets that cache decoded samples in RAM (YOLO's --cache, "cache images").
             "--cache", "cache images", "caching images", "cache-images", "cache_images", "cached images",
             "images into memory", "images in ram"},
       &c->said_data_pipeline);
  SaidWord(all, {"seq2seq", "sequence", "sentence", "utterance", "token", "translation", "speech", "audio", "dialog",
                 "nlp", "point cloud"},
           &c->variable_size_data);
}

}  // namespace oomguard::kb
