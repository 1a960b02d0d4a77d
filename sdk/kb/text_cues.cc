// AnalyzeText (text_cues.h): tracebacks, progress lines and descriptions.
//
// Everything here is plain substring and token matching on lower-cased
// lines, no regular expressions: it runs on the knowledge base's writer thread
// for imported incidents and must stay fast and bounded on hostile input.
// The vocabularies (function names, phrases) are the ones PyTorch,
// TensorFlow, Lightning, Hugging Face, DeepSpeed and common training scripts
// print; docs/patterns.md lists what each cue means.
#include "sdk/kb/text_cues.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <vector>

#include "sdk/kb/text_scan.h"

namespace oomguard::kb {
namespace {

using text::Contains;
using text::ContainsAny;
using text::Lower;
using text::Trim;

// One traceback frame: function, file and the code line shown under it.
struct Frame {
  std::string func, file, code;
};

bool IsFrameish(std::string_view raw) {
  std::string_view s = Trim(raw);
  if (s.empty()) return false;
  static constexpr std::string_view kMarks[] = {
      "file \"", "\", line ", "traceback (most recent call last)", "---> ", "--> ", "-> ", "│", "╭", "╰",
      "frame #", "in function", "exception raised from", "during handling of the above exception",
      "the above exception was the direct cause", "[previous line repeated", "stack traceback:", "^^^", "~~~"};
  std::string l = Lower(s);
  for (std::string_view m : kMarks)
    if (Contains(l, m)) return true;
  if (Contains(l, ".py in ") || Contains(l, ".py:") || Contains(l, "<ipython-input")) return true;
  // Code under a frame is indented.
  return raw.size() > s.size() && (raw[0] == ' ' || raw[0] == '\t') && !Contains(l, "%|");
}

std::string Ident(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '_' || s[i] == '.' ||
                          s[i] == ':' || s[i] == '<' || s[i] == '>'))
    ++i;
  return std::string(s.substr(0, i));
}

// Parses the frame header in `l` (lower-cased) into f; false when none.
bool ParseFrameHeader(std::string_view l, Frame* f) {
  if (size_t at = l.find("file \""); at != std::string_view::npos) {  // Python
    size_t end = l.find('"', at + 6);
    if (end == std::string_view::npos) return false;
    f->file = std::string(l.substr(at + 6, end - at - 6));
    std::replace(f->file.begin(), f->file.end(), '\\', '/');  // Windows paths
    if (size_t in = l.find(", in ", end); in != std::string_view::npos) f->func = Ident(l.substr(in + 5));
    return true;
  }
  if (size_t at = l.find("frame #"); at != std::string_view::npos) {  // c10 C++ frames
    size_t colon = l.find(": ", at);
    if (colon == std::string_view::npos) return false;
    f->func = std::string(l.substr(colon + 2, l.find(" + 0x", colon) - colon - 2));
    return true;
  }
  if (size_t at = l.find("in function '"); at != std::string_view::npos) {  // Lua
    f->func = Ident(l.substr(at + 13));
    f->file = std::string(l.substr(0, at));
    return true;
  }
  // IPython "path.py in func(args)" and rich "path.py:290 in func".
  for (std::string_view sep : {std::string_view(".py in "), std::string_view(" in ")}) {
    size_t at = l.find(sep);
    if (at == std::string_view::npos) continue;
    std::string_view before = l.substr(0, at + (sep.size() == 7 ? 3 : 0));
    if (sep.size() != 7 && !Contains(before, ".py:") && !Contains(before, ".jl:")) continue;
    f->file = std::string(before);
    f->func = Ident(l.substr(at + sep.size()));
    return !f->func.empty();
  }
  return false;
}

// Code shown under a frame: Python's indented line, IPython's "---> 29 code",
// rich's "│ ❱ 290 │ code │".
std::string CodeOf(std::string_view l) {
  std::string_view s = Trim(l);
  for (std::string_view arrow : {std::string_view("--->"), std::string_view("-->"), std::string_view("->")}) {
    if (s.substr(0, arrow.size()) == arrow) {
      s = Trim(s.substr(arrow.size()));
      while (!s.empty() && std::isdigit(static_cast<unsigned char>(s[0]))) s.remove_prefix(1);
      return std::string(Trim(s));
    }
  }
  if (size_t bar = s.find("│"); bar != std::string_view::npos && bar < 3) {
    std::string_view rest = s.substr(bar + 3);
    if (size_t inner = rest.find("│"); inner != std::string_view::npos) rest = rest.substr(inner + 3);
    if (size_t end = rest.rfind("│"); end != std::string_view::npos) rest = rest.substr(0, end);
    return std::string(Trim(rest));
  }
  return std::string(s);
}

// Parses frames of lines [begin, end), written outermost first (Python,
// IPython, rich), into `out` innermost first.
void ParseFrames(const std::vector<std::string>& lower, size_t begin, size_t end, std::vector<Frame>* out) {
  std::vector<Frame> frames;
  for (size_t i = begin; i < end; ++i) {
    Frame f;
    if (ParseFrameHeader(lower[i], &f)) {
      frames.push_back(std::move(f));
      continue;
    }
    std::string code = CodeOf(lower[i]);
    if (code.empty() || code.find_first_not_of("^~│╭╰─ ") == std::string::npos) continue;
    if (!frames.empty() && frames.back().code.empty()) {
      frames.back().code = code;
    } else {
      // A traceback cut above its first header (rich output pasted in part)
      // still shows code.
      f.code = code;
      frames.push_back(std::move(f));
    }
  }
  out->insert(out->end(), frames.rbegin(), frames.rend());
}

// Frames before `anchor` (innermost first) and C++/Lua frames after it. A
// report that states the error first and pastes the traceback below it gets
// the traceback that follows.
std::vector<Frame> CollectFrames(const std::vector<std::string>& lines, const std::vector<std::string>& lower,
                                 size_t anchor, size_t* history_end) {
  *history_end = anchor;
  std::vector<Frame> frames;
  size_t stop = anchor > 400 ? anchor - 400 : 0;
  size_t begin = anchor;
  for (size_t i = anchor; i > stop; --i) {
    const std::string& raw = lines[i - 1];
    if (Trim(raw).empty()) {
      begin = i - 1;
      continue;
    }
    // Code pasted without its indentation sits right under its "File" line.
    bool code_under_header = i >= 2 && Contains(lower[i - 2], "file \"") && Contains(lower[i - 2], ", line ");
    if (!IsFrameish(raw) && !code_under_header) break;
    begin = i - 1;
    if (Contains(lower[i - 1], "traceback (most recent call last)")) break;
  }
  ParseFrames(lower, begin, anchor, &frames);
  if (frames.empty()) {
    // Only a real traceback counts there, not a code snippet: it needs a frame header.
    size_t i = anchor + 1;
    while (i < lines.size() && i < anchor + 80 &&
           !(IsFrameish(lines[i]) && ContainsAny(lower[i], {"traceback", "file \"", ".py in ", ".py:", "frame #"})))
      ++i;
    size_t end = i;
    while (end < lines.size() && (IsFrameish(lines[end]) || Trim(lines[end]).empty())) ++end;
    if (i < end) {
      ParseFrames(lower, i, end, &frames);
      *history_end = i;  // the log lines before that traceback are its history
    }
  }
  // c10 prints "frame #0" (innermost) after the message; Lua prints its
  // traceback after the error too.
  for (size_t i = anchor; i < lines.size() && i < anchor + 40; ++i) {
    Frame f;
    if ((Contains(lower[i], "frame #") || Contains(lower[i], "in function '")) && ParseFrameHeader(lower[i], &f))
      frames.push_back(std::move(f));
  }
  return frames;
}

bool FuncIn(const Frame& f, std::initializer_list<std::string_view> names) {
  for (std::string_view n : names)
    if (f.func == n) return true;
  return false;
}

// The phase one frame belongs to, or "".
std::string FramePhase(const Frame& f) {
  const std::string& file = f.file;
  const std::string& code = f.code;
  if (FuncIn(f, {"save", "_save", "save_checkpoint", "_save_checkpoint", "dump_checkpoint", "consolidate_state_dict",
                 "_save_to_state_dict", "save_pretrained", "save_model", "save_state", "state_dict"}) ||
      ContainsAny(code, {"torch.save(", "save_checkpoint(", "consolidate_state_dict("}))
    return "checkpoint";
  if ((Contains(file, "serialization.py") &&
       FuncIn(f, {"load", "_load", "_legacy_load", "persistent_load", "restore_location", "default_restore_location",
                  "_cuda_deserialize", "load_tensor"})) ||
      FuncIn(f, {"load_state_dict", "_load_from_state_dict", "load_checkpoint", "_load_checkpoint",
                 "load_from_checkpoint", "resume_from_checkpoint", "_load_optimizer_and_scheduler",
                 "restore_training_state", "_load_rng_state"}) ||
      ContainsAny(code, {"torch.load(", "load_state_dict(", "load_checkpoint("}))
    return "load";
  if (ContainsAny(file, {"torch/optim/", "/optim/adam", "runtime/zero/", "apex/optimizers", "bitsandbytes/optim"}) ||
      FuncIn(f, {"_single_tensor_adam", "_multi_tensor_adam", "_single_tensor_adamw", "_multi_tensor_adamw",
                 "_init_group", "optimizer_step", "_maybe_opt_step", "_take_model_step", "_configure_zero_optimizer",
                 "_configure_optimizer", "run_optimizer_step"}) ||
      ContainsAny(code, {"optimizer.step(", "'].step(", "scaler.step(", "exp_avg"}))
    return "optimizer";
  if (FuncIn(f, {"backward", "run_backward", "_engine_run_backward", "manual_backward"}) ||
      ContainsAny(f.func, {"_backward", "backward_out", "autograd::engine"}) ||
      ContainsAny(code, {".backward(", "run_backward("}))
    return "backward";
  // Collectives allocate NCCL's communicators and buffers.
  if (ContainsAny(file, {"distributed_c10d.py", "c10d_logger.py"}) ||
      FuncIn(f, {"barrier", "broadcast", "all_reduce", "all_gather", "reduce_scatter", "init_process_group",
                 "new_group", "_sync_params_and_buffers", "_broadcast_coalesced", "_sync_module_states"}))
    return "comm";
  if (ContainsAny(file, {"torch/utils/data/", "signal_handling.py"}) ||
      FuncIn(f, {"__next__", "_next_data", "_get_data", "_try_get_data", "_worker_loop", "default_collate", "collate",
                 "collate_fn", "_pin_memory_loop", "__getitem__", "_error_if_any_worker_fails"}))
    return "data";
  if ((Contains(file, "torch/nn/modules/module.py") && FuncIn(f, {"_apply", "to", "cuda", "convert"})) ||
      FuncIn(f, {"_move_model_to_device", "_configure_distributed_model", "from_pretrained", "prepare_model"}) ||
      ContainsAny(code, {"t.to(device", "module.to(self.device", "model.to(device", "model.cuda(", "model = model.to(",
                         "deepspeed.initialize(", "accelerator.prepare(", "prepare_model("}))
    return "init";
  if (ContainsAny(file, {"torch/nn/modules/", "torch/nn/functional.py", "/models/", "transformers/"}) ||
      FuncIn(f, {"forward", "_call_impl", "_wrapped_call_impl", "linear", "conv2d", "softmax",
                 "scaled_dot_product_attention"}) ||
      ContainsAny(f.func, {"forward", "conv", "attention"}) ||
      ContainsAny(code, {"= model(", " model(", "(model(", "self.forward(", "self.model("}))
    return "forward";
  return "";
}

bool IsEvalFrame(const Frame& f) {
  return FuncIn(f, {"validate", "validation", "validate_epoch", "valid", "valid_epoch", "valid_step", "evaluate",
                    "evaluation", "_evaluate", "eval_epoch", "val_epoch", "validation_step", "test_step",
                    "predict_step", "eval_step", "evaluation_loop", "prediction_step", "_evaluation_loop",
                    "run_evaluation", "_run_eval", "run_eval", "evaluate_model", "eval_one_epoch", "val_one_epoch",
                    "do_eval", "do_validation", "validation_epoch", "_run_evaluate", "_validate", "val_step"}) ||
         ContainsAny(f.code, {"evaluate(", "validate(", "validation_step("});
}

// Frames that turn gradients off: @torch.no_grad()/inference_mode decorators
// (decorate_context), and framework evaluation loops known to run under
// no_grad (Hugging Face's prediction_step, Lightning's evaluation loop,
// mmcv's test loops, detectron2's inference_on_dataset).
bool IsNoGradFrame(const Frame& f) {
  return f.func == "decorate_context" || ContainsAny(f.file, {"grad_mode.py", "_contextlib.py", "evaluation_loop.py"}) ||
         FuncIn(f, {"prediction_step", "evaluation_loop", "_evaluation_loop", "single_gpu_test", "multi_gpu_test",
                    "inference_on_dataset"}) ||
         ContainsAny(f.code, {"no_grad", "inference_mode", "set_grad_enabled(false"});
}

// TensorFlow names the failing op: "[[node gradients/...]]", "Caused by op
// 'training/Adam/...'", "[[Node: vgg/fc6/weights/Initializer/...".
std::string TensorFlowPhase(std::string_view l, std::string* why) {
  size_t at = std::string_view::npos;
  for (std::string_view key : {"[[node: ", "[[node ", "[[{{node ", "caused by op '"}) {
    at = l.find(key);
    if (at != std::string_view::npos) {
      at += key.size();
      break;
    }
  }
  if (at == std::string_view::npos) return "";
  std::string node = std::string(l.substr(at, std::min<size_t>(200, l.size() - at)));
  node = node.substr(0, node.find_first_of(" ]'"));
  *why = "TensorFlow op `" + node + "`";
  if (ContainsAny(node, {"gradients/", "gradient_tape/", "_grad/", "/grad/"})) return "backward";
  if (ContainsAny(node, {"training/adam", "/adam/", "applyadam", "training/sgd", "training/rmsprop", "/momentum/"}))
    return "optimizer";
  if (ContainsAny(node, {"/initializer/", "/assign"})) return "init";
  return "forward";
}

size_t FindAnchor(const std::vector<std::string>& lower, std::string_view message) {
  std::string first = Lower(Trim(message.substr(0, message.find('\n'))));
  int rank = -1;
  std::string host;
  first = Lower(Trim(StripLinePrefix(first, &rank, &host)));
  if (first.size() > 60) first.resize(60);
  if (first.empty()) return lower.size();
  size_t best = lower.size();
  int best_frames = -1;
  for (size_t i = 0; i < lower.size(); ++i) {
    if (!Contains(lower[i], first)) continue;
    int frames = 0;
    for (size_t k = i; k > 0 && k + 6 > i; --k)
      if (IsFrameish(lower[k - 1])) ++frames;
    if (frames > best_frames) {
      best = i;
      best_frames = frames;
    }
  }
  return best;
}

// Sets *progress_end: where the event's history ends (the anchor, or the
// traceback pasted below it).
void ReadTraceback(const std::vector<std::string>& lines, const std::vector<std::string>& lower, size_t anchor,
                   std::string_view message_lower, TextCues* c, size_t* progress_end) {
  size_t history_end = anchor;
  std::vector<Frame> frames = CollectFrames(lines, lower, anchor, &history_end);
  *progress_end = history_end;
  for (const Frame& f : frames) {
    std::string p = FramePhase(f);
    if (p.empty()) continue;
    if (c->phase.empty()) {
      c->phase = p;
      c->phase_why = "traceback frame `" + (f.func.empty() ? f.code : f.func) + "`";
    } else if (c->phase == "forward" && p == "backward") {
      // Activation checkpointing recomputes the forward inside backward.
      c->phase = "backward";
      c->phase_why = "traceback frame `" + f.func + "` (forward recomputed in backward)";
    }
  }
  for (const Frame& f : frames) {
    if (IsNoGradFrame(f)) c->no_grad.Set("frame `" + (f.func.empty() ? f.code : f.func) + "` runs without gradients");
    if (IsEvalFrame(f)) c->eval.Set("traceback frame `" + (f.func.empty() ? f.code : f.func) + "`");
  }
  if (c->phase.empty()) {
    // TensorFlow names the op near its error: in the message, a title, or the lines around.
    std::string why;
    std::string p = TensorFlowPhase(message_lower, &why);
    for (size_t i = anchor > 20 ? anchor - 20 : 0; p.empty() && i < lower.size() && i < anchor + 20; ++i)
      p = TensorFlowPhase(lower[i], &why);
    if (!p.empty()) {
      c->phase = p;
      c->phase_why = why;
    }
  }
}

}  // namespace

TextCues AnalyzeText(std::string_view context, std::string_view message) {
  TextCues c;
  if (context.size() > 64 * 1024) context = context.substr(context.size() - 64 * 1024);
  std::vector<std::string> lines;
  std::vector<std::string> lower;
  text::SplitClean(context.empty() ? message : context, &lines);
  lower.reserve(lines.size());
  for (std::string& l : lines) {
    int rank = -1;
    std::string host;
    l = std::string(StripLinePrefix(l, &rank, &host));
    lower.push_back(Lower(l));
  }
  const std::string message_lower = Lower(message.substr(0, 16 * 1024));
  const size_t anchor = context.empty() ? lines.size() : FindAnchor(lower, message);
  size_t progress_end = std::min(anchor, lines.size());
  ReadTraceback(lines, lower, std::min(anchor, lines.size()), message_lower, &c, &progress_end);
  ReadProgress(lines, lower, progress_end, &c);
  // Descriptions are prose: progress bars and traceback frames are records,
  // already read above ("Validation: 0%|" is not a person saying "validation").
  std::string all, as_written;
  for (size_t i = 0; i < lower.size(); ++i) {
    const std::string& l = lower[i];
    if (ContainsAny(l, {"%|", "it/s]", "s/it]", "file \"", "frame #"})) continue;
    all += l;
    all += '\n';
    as_written += lines[i];
    as_written += '\n';
  }
  if (context.empty() && lines.empty()) {
    all = Lower(message);
    as_written = std::string(message);
  }
  ReadDescription(all, as_written, &c);
  if (c.eval && !c.no_grad && !ContainsAny(all, {"no_grad", "inference_mode", "set_grad_enabled(false"}) &&
      ContainsAny(all, {".eval()", "def validate", "def evaluate", "validation_step"}))
    c.eval_code_without_no_grad.Set("the evaluation code shown never disables gradients (no torch.no_grad / "
                                     "inference_mode)");
  return c;
}

}  // namespace oomguard::kb
