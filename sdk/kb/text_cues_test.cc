#include "sdk/kb/text_cues.h"

#include <gtest/gtest.h>

namespace oomguard::kb {
namespace {

std::string Py(std::initializer_list<std::pair<const char*, const char*>> frames, const char* error) {
  std::string t = "Traceback (most recent call last):\n";
  for (auto [head, code] : frames) t += std::string("  File ") + head + "\n    " + code + "\n";
  return t + error + "\n";
}

TEST(TextCuesTest, PhaseFromTheInnermostPythonFrame) {
  const char* oom = "torch.cuda.OutOfMemoryError: CUDA out of memory.";
  struct Case {
    std::string text;
    const char* phase;
  } cases[] = {
      {Py({{"\"train.py\", line 9, in main", "loss.backward()"},
           {"\"torch/autograd/__init__.py\", line 266, in backward", "Variable._execution_engine.run_backward("}},
          oom),
       "backward"},
      {Py({{"\"train.py\", line 29, in train", "optimizer.step()"},
           {"\"/usr/lib/python3/torch/optim/adam.py\", line 77, in step", "state['exp_avg_sq'] = torch.zeros_like(p)"}},
          oom),
       "optimizer"},
      {Py({{"\"demo.py\", line 124, in <module>", "checkpoint = torch.load(args.checkpoint)"},
           {"\"torch/serialization.py\", line 135, in _cuda_deserialize", "return storage_type(obj.size())"}},
          oom),
       "load"},
      {Py({{"\"train.py\", line 50, in main", "for batch in loader:"},
           {"\"torch/utils/data/dataloader.py\", line 435, in __next__", "data = self._next_data()"}},
          oom),
       "data"},
      {Py({{"\"train.py\", line 80, in main", "trainer.save_checkpoint(path)"},
           {"\"fairscale/optim/oss.py\", line 360, in consolidate_state_dict", "self._broadcast_state()"}},
          oom),
       "checkpoint"},
      {Py({{"\"train.py\", line 273, in train", "output = segmenter(input_var)"},
           {"\"torch/nn/modules/module.py\", line 493, in __call__", "result = self.forward(*input)"}},
          oom),
       "forward"},
      {Py({{"\"ds.py\", line 1103, in _configure_distributed_model", "self.module.to(self.device)"}}, oom), "init"},
  };
  for (const Case& c : cases) EXPECT_EQ(AnalyzeText(c.text, oom).phase, c.phase) << c.text;
}

TEST(TextCuesTest, RecomputedForwardInsideBackwardIsBackward) {
  const char* oom = "torch.cuda.OutOfMemoryError: CUDA out of memory.";
  std::string t = Py({{"\"train.py\", line 9, in main", "loss.backward()"},
                      {"\"torch/utils/checkpoint.py\", line 157, in backward", "outputs = ctx.run_function(*inputs)"},
                      {"\"torch/nn/modules/linear.py\", line 114, in forward", "return F.linear(input, self.weight)"}},
                     oom);
  EXPECT_EQ(AnalyzeText(t, oom).phase, "backward");
}

TEST(TextCuesTest, OtherTracebackFormats) {
  // IPython, with the error before the frames of the report.
  const char* ipy =
      "RuntimeError: CUDA out of memory.\n"
      "---------------------------------------------------------------------------\n"
      "RuntimeError                              Traceback (most recent call last)\n"
      "/usr/lib/python3/site-packages/torch/optim/adamw.py in step(self, closure)\n"
      "--> 220         adamw(\n";
  EXPECT_EQ(AnalyzeText(ipy, "RuntimeError: CUDA out of memory.").phase, "optimizer");
  // c10's C++ frames follow the message, innermost first.
  const char* c10 =
      "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`\n"
      "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x4d (0x2b in libc10.so)\n"
      "frame #4: at::native::slow_conv_transpose3d_backward_out_cuda_template(at::Tensor const&) + 0x15ef (0x2b)\n";
  EXPECT_EQ(AnalyzeText(c10, "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED").phase, "backward");
  // TensorFlow names the op.
  const char* tf = "ResourceExhaustedError: OOM when allocating tensor with shape[25088,4096] and type float\n"
                   "\t [[Node: vgg_16/fc6/weights/Initializer/random_uniform/RandomUniform = RandomUniform[]()]]\n";
  EXPECT_EQ(AnalyzeText(tf, "ResourceExhaustedError: OOM when allocating tensor").phase, "init");
  EXPECT_EQ(AnalyzeText("", "OOM when allocating ... [[{{node gradients/conv1/Conv2DBackpropInput}}]]").phase,
            "backward");
}

TEST(TextCuesTest, EvaluationAndNoGrad) {
  const char* oom = "RuntimeError: CUDA error: out of memory";
  TextCues c = AnalyzeText(Py({{"\"train.py\", line 282, in validate", "scores_copy = scores.clone()"}}, oom), oom);
  EXPECT_TRUE(c.eval) << c.eval.why;
  EXPECT_FALSE(c.no_grad);
  c = AnalyzeText(Py({{"\"torch/utils/_contextlib.py\", line 115, in decorate_context", "return func(*args)"},
                      {"\"train.py\", line 282, in validate", "scores_copy = scores.clone()"}},
                     oom),
                  oom);
  EXPECT_TRUE(c.eval);
  EXPECT_TRUE(c.no_grad) << "decorate_context is @torch.no_grad()";
  // Hugging Face's prediction_step runs under no_grad.
  c = AnalyzeText(Py({{"\"transformers/trainer.py\", line 3262, in prediction_step", "outputs = model(**inputs)"}}, oom),
                  oom);
  EXPECT_TRUE(c.eval);
  EXPECT_TRUE(c.no_grad);
  // A validation progress bar on the failing line.
  c = AnalyzeText("Valid (loss 53.34) epoch 1:   9%|#    | 1/11 [00:01<00:13]THCudaCheck FAIL error=2 : out of memory\n",
                  "THCudaCheck FAIL error=2 : out of memory");
  EXPECT_TRUE(c.eval) << c.eval.why;
}

TEST(TextCuesTest, ProgressLines) {
  const char* oom = "CUDA out of memory.";
  TextCues c = AnalyzeText("  0%|          | 0/1000 [00:00<?, ?it/s]\nCUDA out of memory.\n", oom);
  EXPECT_TRUE(c.first_step);
  EXPECT_EQ(c.step, 0);
  c = AnalyzeText("Epoch [3][50/7330]\tlr: 1e-4, loss: 0.9\nEpoch [3][100/7330]\tlr: 1e-4\nCUDA out of memory.\n", oom);
  EXPECT_FALSE(c.first_step);
  EXPECT_EQ(c.step, 100);
  EXPECT_EQ(c.steps_done, 100);
  EXPECT_EQ(c.epochs_done, 2);  // epoch 3 running: at least 2 complete
  c = AnalyzeText("ep 13 train, step 95, ctc 4.293, mem_usage:cuda:0 8.9GB\nCUDA out of memory.\n", oom);
  EXPECT_EQ(c.step, 95);
  EXPECT_EQ(c.epochs_done, 12);
  c = AnalyzeText("Epoch 9 - learning rate: 0.0001\navg_loss: 0.013 [++++++++, 1464 / 1464, 100%]\nCUDA out of memory.\n",
                  oom);
  EXPECT_EQ(c.epochs_done, 9);  // epoch 9 shown complete
  // What ran before: a resume, a dataset preparation, loading weights.
  c = AnalyzeText("Restoring states from the checkpoint path at out/last.ckpt\nEpoch 0:  1%| | 3/500\nCUDA out of memory.\n",
                  oom);
  EXPECT_TRUE(c.resumed);
  EXPECT_NE(c.resumed.why.find("Restoring states from the checkpoint path at out/last.ckpt"), std::string::npos)
      << "quoted as written: " << c.resumed.why;
  c = AnalyzeText("Processing...\n100%|#####| 205944/205944 [18:54<00:00]\nKilled\n", "Killed");
  EXPECT_TRUE(c.data_prep);
  EXPECT_FALSE(c.steps_done.has_value()) << "the dataset's bar is not training progress";
  c = AnalyzeText("Loading checkpoint shards:  38%|##                                  | 3/8 [00:02<00:03]Killed\n",
                  "Killed");
  EXPECT_TRUE(c.loading_weights);
  EXPECT_EQ(c.loading_weights.why.find("   "), std::string::npos) << "a bar's blanks are shortened: "
                                                                     << c.loading_weights.why;
}

TEST(TextCuesTest, Descriptions) {
  TextCues c = AnalyzeText("", "but after 15K training steps, `cuda runtime error with out of memory`");
  EXPECT_EQ(c.said_steps_done, 15000);
  c = AnalyzeText("", "I train normally before the 55th epoch. out of memory");
  EXPECT_EQ(c.said_epochs_done, 54);
  c = AnalyzeText("", "GPU is out of memory after training on a few thousand of examples");
  EXPECT_EQ(c.said_steps_done, 1000);
  // The failure at a numbered epoch or step, and "in" an amount right after the failure is named.
  EXPECT_EQ(AnalyzeText("", "CUDA out of memory at epoch 5.").said_epochs_done, 4);
  EXPECT_EQ(AnalyzeText("", "OOM happens at iteration 3000.").said_steps_done, 3000);
  EXPECT_EQ(AnalyzeText("", "I got the ''out of memory'' in about 100 epochs.").said_epochs_done, 100);
  // A plan, or an epoch number with no failure near it, says nothing ran.
  EXPECT_FALSE(AnalyzeText("", "The model converges in 10 epochs on one GPU.").said_epochs_done.has_value());
  EXPECT_FALSE(AnalyzeText("", "Set the learning rate at epoch 30 to 0.01.").said_epochs_done.has_value());
  EXPECT_FALSE(AnalyzeText("", "It does not run out of memory at epoch 5 any more.").said_epochs_done.has_value());
  EXPECT_TRUE(AnalyzeText("", "a slow and steady increase is visible").said_growth);
  // ultralytics/yolov5#2877: a dataset that caches decoded images in RAM is the data pipeline.
  EXPECT_TRUE(AnalyzeText("", "When I try and use `--cache` while training it gets killed").said_data_pipeline);
  EXPECT_FALSE(AnalyzeText("", "the allocator cache holds 2 GiB").said_data_pipeline);
  EXPECT_TRUE(AnalyzeText("", "it fails when I resume training from a checkpoint").said_resume);
  EXPECT_TRUE(AnalyzeText("", "the first GPU occupies much more memory than the others").said_imbalance);
  EXPECT_TRUE(AnalyzeText("", "another process was using the GPU").said_other_process);
  EXPECT_FALSE(AnalyzeText("", "there is no other process on the GPU").said_other_process);  // negated
  EXPECT_TRUE(AnalyzeText("", "OOM during validation after the epoch").said_eval);
  EXPECT_FALSE(AnalyzeText("", "--validation_file dev.txt --do_eval").said_eval);  // configuration, not events
  EXPECT_FALSE(AnalyzeText("", "OOM after the first epoch").said_first);
  EXPECT_TRUE(AnalyzeText("", "OOM at the first iteration").said_first);
  // Quotes are as written, though the search ignores case.
  c = AnalyzeText("Epoch 3\nIt fails when I Resume Training from the LoRA checkpoint\n", "CUDA out of memory");
  ASSERT_TRUE(c.said_resume);
  EXPECT_NE(c.said_resume.why.find("Resume Training from the LoRA checkpoint"), std::string::npos)
      << c.said_resume.why;
}

// The rest of the line after the prefix keeps its indentation (code under
// a traceback frame is indented); compare it trimmed.
std::string Rest(const char* line, int* rank, std::string* host) {
  std::string_view s = StripLinePrefix(line, rank, host);
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  return std::string(s);
}

TEST(TextCuesTest, LinePrefixes) {
  int rank = -1;
  std::string host;
  EXPECT_EQ(Rest("[rank3]: torch.OutOfMemoryError: CUDA", &rank, &host), "torch.OutOfMemoryError: CUDA");
  EXPECT_EQ(rank, 3);
  EXPECT_EQ(std::string(StripLinePrefix("[rank1]:     loss.backward()", &rank, &host)), "     loss.backward()");
  rank = -1;
  EXPECT_EQ(Rest("worker-5: [rank22]:   File \"x.py\"", &rank, &host), "File \"x.py\"");
  EXPECT_EQ(rank, 22);
  rank = -1;
  EXPECT_EQ(Rest("ng30903:3063028:3066152 [3] include/alloc.h:178 NCCL WARN Cuda failure", &rank, &host),
            "include/alloc.h:178 NCCL WARN Cuda failure");
  EXPECT_EQ(host, "ng30903");
  EXPECT_EQ(rank, 3);
  rank = -1;
  host.clear();
  EXPECT_EQ(Rest("[2059991.491542] Out of memory: Killed process 25315", &rank, &host),
            "Out of memory: Killed process 25315");
  EXPECT_EQ(Rest("2021-06-02 15:50:53 dev-ssh-geza root[14429] DEBUG CUDA out of memory", &rank, &host),
            "CUDA out of memory");
  EXPECT_EQ(host, "dev-ssh-geza");
  host.clear();
  EXPECT_EQ(Rest("ERROR 04-01 23:46:56 [engine.py:160] torch.OutOfMemoryError: x", &rank, &host),
            "torch.OutOfMemoryError: x");
  EXPECT_EQ(host, "");
  EXPECT_EQ(Rest("[0/795]Killed", &rank, &host), "[0/795]Killed");
  rank = -1;
  EXPECT_EQ(Rest("RANK 3: RuntimeError: CUDA out of memory.", &rank, &host), "RuntimeError: CUDA out of memory.");
  EXPECT_EQ(rank, 3);
  rank = -1;
  EXPECT_EQ(Rest("[RANK 5] step 10", &rank, &host), "step 10");
  EXPECT_EQ(rank, 5);
  rank = -1;
  // Prose that names a rank is not a prefix.
  EXPECT_EQ(Rest("rank 3 ran out of memory", &rank, &host), "rank 3 ran out of memory");
  EXPECT_EQ(rank, -1);
}

}  // namespace
}  // namespace oomguard::kb
