// What the text around an OOM says beyond the message's figures: the phase
// the traceback was in, the training progress logged before it, and what the
// person reporting it wrote in plain words.
//
// Real OOM reports rarely carry step peaks or per-rank memory; they carry a
// traceback, some log lines and a description. AnalyzeText reads those, and
// says for every cue which text decided it, so the classifier can quote it.
// The log importer (log_parser.h) uses the same reading to fill an
// incident's phase and step, and the classifier re-reads an incident's stored
// context, so a stored incident classifies the same way again.
//
// Thread-safety: pure functions.
#ifndef OOMGUARD_SDK_KB_TEXT_CUES_H_
#define OOMGUARD_SDK_KB_TEXT_CUES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace oomguard::kb {

// A cue and the text that decided it ("frame `_cuda_deserialize`").
struct Cue {
  bool on = false;
  std::string why;
  explicit operator bool() const { return on; }
  void Set(std::string reason) {
    if (on) return;
    on = true;
    why = std::move(reason);
  }
};

struct TextCues {
  // ---- from the traceback (frames, code lines, TensorFlow node names) ----
  // data, forward, backward, optimizer, checkpoint (saving), load (restoring),
  // init (moving the model to the device, building it), or "" when unknown.
  std::string phase;
  std::string phase_why;
  Cue eval;       // an evaluation/validation function, progress line or description
  Cue no_grad;    // gradients are off there: no_grad/inference_mode frame or code, or an eval loop that disables them
  Cue eval_code_without_no_grad;  // code of an evaluation loop is shown and nothing in the text disables gradients

  // ---- from log lines before the OOM ----
  std::optional<int64_t> step;         // the last training step/iteration count logged
  std::optional<int64_t> steps_done;   // training steps logged as done before the OOM
  std::optional<int64_t> epochs_done;  // epochs logged as complete
  Cue first_step;                      // the last progress logged says nothing had completed (0/N)
  Cue resumed;                         // a checkpoint was restored before the OOM
  Cue loading_weights;                 // model weights were being loaded (checkpoint shards, from_pretrained)
  Cue data_prep;                       // dataset preparation was running (Processing..., tokenizing)
  std::string progress_why;            // the progress line quoted

  // ---- from the description (prose a person wrote) ----
  std::optional<int64_t> said_steps_done;   // "after 15K steps", "for three update steps"
  std::optional<int64_t> said_epochs_done;  // "after ~2 epochs", "before the 55th epoch"
  Cue said_first;            // "at the first iteration", "at the beginning of training"
  Cue said_batch_one;        // "even with batch size 1": the model alone does not fit
  Cue said_model_to_device;  // "when initializing the model", "module.to(self.device)" quoted
  Cue said_growth;           // "memory keeps increasing", "memory leak"
  Cue said_batch_specific;   // "long lines", "always stops at the same step", "non-deterministic"
  Cue said_eval;             // "during validation", "on the test set"
  Cue said_grad_on;          // "without turning gradient computations off"
  Cue said_resume;           // "resume training from a checkpoint"
  Cue said_pretrained;       // "when using pretrained weights", "loads pretrained weight"
  Cue said_save;             // "when saving the checkpoint", "consolidate_state_dict"
  Cue said_imbalance;        // "the first GPU uses much more memory than the others"
  Cue said_other_process;    // "another process was using the GPU"
  Cue said_no_workers;       // "num_workers set to 0"
  Cue said_adam_not_sgd;     // Adam fails where SGD fits
  Cue said_loading_weights;  // "merging LoRA weights", "loading the model"
  Cue said_data_pipeline;    // DataLoader workers, prefetching, shared memory
  Cue variable_size_data;    // sequences, sentences, utterances, audio, graphs: sizes vary per sample
};

// Reads `context` (the text around the OOM; may be empty) and `message` (the
// error itself). The traceback and progress are taken from before the first
// line of `message` inside `context` (or from all of it when the message is
// not found there); descriptions from all of it. Bounded: reads at most the
// last 64 KiB of context.
TextCues AnalyzeText(std::string_view context, std::string_view message);

// Strips what launchers and loggers put in front of a line ("[rank3]: ",
// "[default3]:", "worker-5: ", "> ", "│ ", timestamps and log levels) and
// returns the rest. Sets *rank (when the prefix names one; else leaves it)
// and *host (NCCL's "host:pid:tid [dev]", syslog's "Mon DD hh:mm:ss host").
std::string_view StripLinePrefix(std::string_view line, int* rank, std::string* host);

}  // namespace oomguard::kb

#endif  // OOMGUARD_SDK_KB_TEXT_CUES_H_
