// The formats of real reports that the log importer once did not find an
// OOM in (issue 25): each text is quoted from a report of the corpus
// (tests/kb/testdata/corpus), cut to the lines that matter.
#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "oomguard/knowledge_base.h"
#include "sdk/kb/log_parser.h"
#include "sdk/kb/text_scan.h"

namespace oomguard::kb {
namespace {

std::vector<Incident> Parse(const std::string& text) {
  LogParseOptions o;
  o.source_name = "report.txt";
  auto r = ParseOomLog(text, o);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::vector<Incident>{};
}

// Each text holds exactly one OOM, of `kind`.
void ExpectOneOomOfKind(IncidentKind kind, std::initializer_list<const char*> texts) {
  for (const char* text : texts) {
    auto incs = Parse(text);
    ASSERT_EQ(incs.size(), 1u) << text;
    EXPECT_EQ(incs[0].kind, kind) << text;
  }
}

// `text` holds exactly one OOM, of `kind`, asking for `requested` bytes.
void ExpectOneOomAsking(const char* text, IncidentKind kind, int64_t requested) {
  auto incs = Parse(text);
  ASSERT_EQ(incs.size(), 1u) << text;
  EXPECT_EQ(incs[0].kind, kind) << text;
  EXPECT_EQ(incs[0].requested_bytes, requested) << text;
}

TEST(LogParserFormatsTest, TensorFlowStreamExecutorNamesTheBytesItFailedToAllocate) {
  // tensorflow/tensorflow#8170
  ExpectOneOomAsking(
      "I tensorflow/core/common_runtime/gpu/gpu_device.cc:885] Found device 0 with properties:\n"
      "Total memory: 7.92GiB\n"
      "Free memory: 190.31MiB\n"
      "E tensorflow/stream_executor/cuda/cuda_driver.cc:1002] failed to allocate 190.31M (199557120 bytes) from "
      "device: CUDA_ERROR_OUT_OF_MEMORY\n",
      IncidentKind::kDevice, 199557120);
}

TEST(LogParserFormatsTest, DataLoaderSharedMemoryBusErrorIsAHostEvent) {
  // pangeo-data/pangeo-docker-images#258
  auto incs = Parse(
      "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).\n"
      "Traceback (most recent call last):\n"
      "  File \"/srv/conda/envs/notebook/lib/python3.8/multiprocessing/queues.py\", line 239, in _feed\n"
      "RuntimeError: unable to write to file </torch_1394_2747491098>\n");
  ASSERT_GE(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  ClassifyInPlace(&incs[0]);
  EXPECT_EQ(incs[0].pattern, "host_dataloader") << incs[0].evidence;
}

TEST(LogParserFormatsTest, ShardsBarKilledQuotedInATitle) {
  // eosphoros-ai/DB-GPT#63's title, and a bar cut by "Killed" mid-sentence.
  auto incs = Parse("# Loading checkpoint shards: 0%| | 0/2 [00:00<?, ?it/s]Killed\n这个是对内存有什么要求吗\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
}

TEST(LogParserFormatsTest, LauncherMinusNineIsAHostKill) {
  // deepspeedai/DeepSpeed#3232
  auto incs = Parse(
      "[2023-04-14 13:11:27,879] [INFO] [launch.py:428:sigkill_handler] Killing subprocess 13266\n"
      "[2023-04-14 13:11:27,885] [ERROR] [launch.py:434:sigkill_handler] ['/usr/bin/python3', '-u', 'main.py', "
      "'--local_rank=0'] exits with return code = -9\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
}

TEST(LogParserFormatsTest, CudnnNotSupportedIsAWorkspaceFailure) {
  // soumith/cudnn.torch#384
  auto incs = Parse(
      "/home/ubuntu/torch/install/share/lua/5.1/cudnn/find.lua:94: Error in CuDNN: CUDNN_STATUS_NOT_SUPPORTED "
      "(cudnnConvolutionBackwardData)\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kWorkspace);
}

TEST(LogParserFormatsTest, TensorFlowsCudnnHandleAndXlaReservationsAreOoms) {
  // tony-framework/TonY#486, pytorch/xla#2569
  auto incs = Parse(
      "2020-11-25 09:06:12.391615: E tensorflow/stream_executor/cuda/cuda_dnn.cc:328] Could not create cudnn handle: "
      "CUDNN_STATUS_INTERNAL_ERROR\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kWorkspace);
  incs = Parse(
      "2020-10-22 02:48:58 10.128.0.33 [3]   (1) Resource exhausted: Attempting to allocate 180.59M. That was not "
      "possible. There are 142.58M free.; (0x3x0_HBM1)\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
  // A resource other than memory is not an OOM.
  EXPECT_TRUE(Parse("Resource exhausted: too many open files\n").empty());
}

TEST(LogParserFormatsTest, OomsToldOnlyInWords) {
  // pytorch/pytorch#1840, basiclab/GNGAN-PyTorch#2, a Chinese report.
  for (const char* text : {"the memory grows unlimitly **until OOM**\n",
                           "the GPU memory usage keeps ceaselessly growing, and finally, it blows up.\n",
                           "训练到一半显存不足，程序退出了\n"}) {
    auto incs = Parse(text);
    EXPECT_EQ(incs.size(), 1u) << text;
  }
  // A sentence about memory that reports no failure is not an OOM.
  EXPECT_TRUE(Parse("Training uses about 10 GB of GPU memory and runs fine.\n").empty());
}

TEST(LogParserFormatsTest, OomsToldWithWordsBetweenOrAsAVerb) {
  // DeepInsight-PCALab/CompactBilinearPooling-Pytorch#5, GeoZcx/...change-detection#14, tinygrad/tinygrad#3323,
  // sgl-project/SpecForge#739, PaddlePaddle/models#3011.
  for (const char* text : {"I just run the test, and it run out of my cuda memory, which is 20G.\n",
                           "I have set the batchsize of 32, but it still out of memories\n",
                           "the current ops_torch.py backend ooms because of memory fragmentation on a 4090\n",
                           "allocator fragmentation that can surface as late OOMs\n",
                           "`Cannot malloc 49.0002 MB GPU memory. Please shrink FLAGS_fraction_of_gpu_memory_to_use`\n",
                           // ultralytics/yolov3#1381, dvornikita/fewshot_ensemble#4
                           "error occured:\nCUDA out of memeory,\n",
                           "it continues to increase beyond 16 gb which is the max. RAM that I have hence system "
                           "crashes.\n",
                           // kingoflolz/mesh-transformer-jax#120, hkproj/pytorch-transformer#3
                           "it has stopped working for me, saying \"Your session crashed after using all available "
                           "RAM\".\n",
                           "When training on google colab second epoch for me fails due to cuda memory limit\n",
                           // pytorch/pytorch#22133, instadeepai/Mava#220
                           "15 new python processes are created every epoch, which leads to the memory is out.\n",
                           "Currently the trainer uses all the GPU memory. This causes a crash as soon as some other "
                           "function requests GPU memory.\n",
                           // NVIDIA/DeepLearningExamples#691
                           "when trying to increase batch size from 192 to 256, cuda malloc error occurs\n",
                           // ROCm/Tensile#197, rsanchezgarc/deepEMhancer#3
                           "The seemingly random alloc failure to allocate ~ 286GB was caused by the default sizes\n",
                           "I have a 512x512x512 volume that is crashing the memory of my K80 GPUs\n"}) {
    auto incs = Parse(text);
    EXPECT_EQ(incs.size(), 1u) << text;
  }
  // "out of" far from any memory word, and "oom" inside a word, are not OOMs.
  EXPECT_TRUE(Parse("We ran out of time before the room emptied; memory was fine.\n").empty());
  EXPECT_TRUE(Parse("The zoom level of the plots is out of date.\n").empty());
  EXPECT_TRUE(Parse("The viewer crashes when the window is full screen.\n").empty());
  EXPECT_TRUE(Parse("Set the memory limit of the container in the compose file.\n").empty());
  EXPECT_TRUE(Parse("Setting memory growth stops TensorFlow from taking all the GPU memory.\n").empty());
  EXPECT_TRUE(Parse("The loader failed to allocate a worker slot, retrying in 5 s.\n").empty());
}

TEST(LogParserFormatsTest, WorkersTheKernelKilledAreHostMemory) {
  // unslothai/unsloth#7831: datasets' map() workers killed when RAM runs out.
  auto incs = Parse(
      "Training intermittently dies with `RuntimeError: One of the subprocesses has abruptly died during map "
      "operation.`\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // pytorch/pytorch#22133: workers started anew each epoch.
  incs = Parse("I set num_workers 15; every epoch 15 new python processes are created, so the memory is out.\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
}

TEST(LogParserFormatsTest, SharedMemoryAndMemoryEatenUntilKilledAreHostOoms) {
  // tahoebio/tahoe-x1#63, senwu/emmental#121
  for (const char* text :
       {"PyTorch's DataLoader previously crashed with Bus error / No space left on device due to Docker's default "
        "/dev/shm limit (64 MB).\n",
        "storing 3x the dataset size in intermediate dicts/arrays during evaluation quickly eats up memory and kills "
        "the job\n"}) {
    auto incs = Parse(text);
    ASSERT_EQ(incs.size(), 1u) << text;
    EXPECT_EQ(incs[0].kind, IncidentKind::kHost) << text;
  }
  // WongKinYiu/yolov9#619: in words; xuannianz/keras-CenterNet#23: TensorFlow's system-memory warning, then killed.
  auto incs = Parse("The GPU memory is not being allocated properly. It causes the memory to exceed its limit.\n");
  EXPECT_EQ(incs.size(), 1u);
  incs = Parse("I just see Epoch 1/200 and Killed.\n```\nAllocation of 1426063360 exceeds 10% of system memory.\n```\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // Linaqruf/kohya-trainer#231: memory filled until the notebook crashed.
  incs = Parse("the colab always crashes at cell 5.2.\nIt runs until the RAM is full.\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // The warning alone is not a failure, nor "killed" without it.
  EXPECT_TRUE(Parse("Allocation of 1426063360 exceeds 10% of system memory.\nEpoch 1/200 done\n").empty());
  EXPECT_TRUE(Parse("I killed the job myself after epoch 3.\n").empty());
  // A kill someone ordered is not an OOM; a kill with memory in the sentence still is.
  EXPECT_TRUE(Parse("The job state is KILLED by the user.\n").empty());
  EXPECT_TRUE(Parse("The first run was killed manually after an hour.\n").empty());
  EXPECT_TRUE(Parse("The program was killed by the user with Ctrl-C.\n").empty());
  EXPECT_EQ(Parse("The process was killed by the user's shell after memory hit 60 GB.\n").size(), 1u);
  EXPECT_EQ(Parse("The process is killed every time at epoch 2.\n").size(), 1u);
  // Memory in use without a failure, and a disk that is full, are not OOMs.
  EXPECT_TRUE(Parse("The cache eats up memory quickly but the run finishes.\n").empty());
  EXPECT_TRUE(Parse("Saving failed: No space left on device (/data is full).\n").empty());
}

TEST(LogParserFormatsTest, VllmStartupShortfallIsADeviceOom) {
  // vllm-project/vllm#50135
  auto incs = Parse(
      "ValueError: Free memory on device xpu:0 (0.22/30.3 GiB) on startup is less than desired GPU memory "
      "utilization (0.7, 21.21 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
      "processes.\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
}

TEST(LogParserFormatsTest, GrowthToldInWordsIsGradualGrowth) {
  auto incs = Parse(
      "# pytorch's gpu memory usage is ceaselessly grow up\n"
      "when i run this code, the memory grows unlimitly until OOM\n");
  ASSERT_EQ(incs.size(), 1u);
  ClassifyInPlace(&incs[0]);
  EXPECT_EQ(incs[0].pattern, "gradual_growth") << incs[0].evidence;
}

TEST(LogParserFormatsTest, PaddleShortfallAKilledTitleAndOutMemoryInWords) {
  // PaddlePaddle/Paddle#15458
  auto incs = Parse(
      "paddle.fluid.core.EnforceNotMet: Enforce failed. Expected allocating <= available, but received "
      "allocating:20998686233 > available:19587333888.\n"
      "Insufficient GPU memory to allocation. at [/paddle/paddle/fluid/platform/gpu_info.cc:170]\n");
  ASSERT_EQ(incs.size(), 1u);
  // SharifAmit/RVGAN#14
  EXPECT_EQ(Parse("# Killed error\nI got this error. I tried to drop batch size, it didn't work.\n").size(), 1u);
  // megvii-research/tf-tutorials#69
  EXPECT_EQ(Parse("# 请问一下为什么会out memory？\n![image](https://example.invalid/a.png)\n").size(), 1u);
  // "without memory" is not "out memory".
  EXPECT_TRUE(Parse("The model runs without memory problems on the CPU.\n").empty());
}

TEST(LogParserFormatsTest, Batch13FormatsAKvCacheShortfallAColabKillAndExplodingMemory) {
  // QwenLM/Qwen3#295: vLLM refusing a max model length its KV cache cannot hold.
  auto incs = Parse(
      " raise ValueError(\n"
      "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored "
      "in KV cache (7344). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing "
      "the engine.\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
  // kaleido-lab/dolphin#1: Colab's ^C when its runtime kills a process that filled the RAM.
  incs = Parse("# Loading checkpoint shards: 0% 0/2 [00:00<?, ?it/s]^C\nCan't run it on free colab T4\n");
  ASSERT_EQ(incs.size(), 1u);
  // pytorch/pytorch#558: a library's scratch memory that could not be allocated, in words.
  EXPECT_EQ(Parse("If we can't allocate the workspace for the desired algorithm, we fall\nback to a default.\n").size(),
            1u);
  // huggingface/accelerate#3655 and Algolzw/image-restoration-sde#103.
  EXPECT_EQ(Parse("all are loaded into `cuda:0`, causing `cuda:0` memory to explode. Is my usage correct?\n").size(), 1u);
  EXPECT_EQ(Parse("# 关于采样阶段显存爆炸问题，训练正常\n我在deshadow文件夹训练正常\n").size(), 1u);
  // A bar a user interrupted is no OOM without a bar's fraction before it; a ^C alone is not one.
  EXPECT_TRUE(Parse("I pressed ^C to stop it.\n").empty());
  EXPECT_TRUE(Parse("We store the workspace path in the config.\n").empty());
}

TEST(LogParserFormatsTest, Batch14FormatsTheParsersMissedAtFirstContact) {
  // Gary3410/TaPA#1: a conversion killed for host RAM, the shell's "Killed" in a Chinese locale after the bar.
  auto incs = Parse("  0%|                                   | 0/1 [00:00<?, ?it/s]已杀死\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // hiyouga/LlamaFactory#7315: a title with the marker's words misspelt.
  incs = Parse("# 提示bus error，insufficient shared memery (shm)\n同样的脚本，但是单机能运行\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // openai/jukebox#27: a notebook's crash, misspelt.
  incs = Parse("# Colab crashes after using all avilable RAM\nOn the model loading step\n");
  ASSERT_EQ(incs.size(), 1u);
  // jingyaogong/minimind#522: "overflows the GPU memory" after training a while.
  incs = Parse("# 求问为什么训练一段时间后就会溢出显存\n训练开始的时候，显存应该是有空余的\n");
  ASSERT_EQ(incs.size(), 1u);
  // Near misses stay quiet: a bus error with no shared memory, a process the user killed, a sentence about RAM.
  EXPECT_TRUE(Parse("Bus error (core dumped) in the CUDA extension's build step.\n").empty());
  EXPECT_TRUE(Parse("我手动把进程杀死了\n").empty());
  EXPECT_TRUE(Parse("After using all the augmentations the accuracy improved.\n").empty());
}
TEST(LogParserFormatsTest, Batch15FormatsTheParsersMissedAtFirstContact) {
  // FenTechSolutions/CausalDiscoveryToolbox#9: PyTorch 0.4's CPU allocator.
  auto incs = Parse("```\nnot enough memory: you tried to allocate 160465GB. Buy new RAM! at "
                    "/opt/conda/conda-bld/pytorch_1524584710464/work/aten/src/TH/THGeneral.c:218\n```\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // In words: keras-team/keras#246, huggingface/transformers#24946, microsoft/BitNet#120,
  // TheLastBen/fast-stable-diffusion#1567, #200 and #1344.
  for (const char* text :
       {"# The test method of model will drain memory easily and result in errors\nit's very easy to exhaust "
        "memory when the size of test example is large enough\n",
        "# convertion to hf format of llama2 70b get kill\nRAM: 20G, 8Core\n",
        "# Model conversion from HF to GGUF crashes due to lack of memory\nquickly ran through the 32GB RAM on my "
        "Linux PC.\n",
        "# huge ram issue when changing models\nmost of the time when you want to change a model, the max RAM memory "
        "is reached.\n",
        "# Doesn't load v1.5 pruned(7gb)\nIt gives a C^ error instead of loading it.\n",
        "# Running from colab doesn't work anymore...\nIt just keeps taking up all the 12 GB RAM and then crashes.\n"}) {
    incs = Parse(text);
    ASSERT_EQ(incs.size(), 1u) << text;
    // Host memory where the report names RAM or a kill; with no word for either memory, a device OOM.
    const std::string lower = text::Lower(text);
    const bool host = lower.find("ram") != std::string::npos || lower.find("kill") != std::string::npos;
    EXPECT_EQ(incs[0].kind, host ? IncidentKind::kHost : IncidentKind::kDevice) << text;
  }
  // Near misses stay quiet.
  EXPECT_TRUE(Parse("The maximum learning rate is reached at step 500.\n").empty());
  EXPECT_TRUE(Parse("We use all the memory-efficient attention kernels we can.\n").empty());
  EXPECT_TRUE(Parse("Drain the queue before you exit.\n").empty());
}

TEST(LogParserFormatsTest, Batch16FormatsTheParsersMissedAtFirstContact) {
  // turboderp/exllama#245: PyTorch's file mapping, quoted without its reason; the mapping is the request.
  auto incs = Parse("I get an error like: `RuntimeError: unable to mmap 33484977464 bytes`\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  EXPECT_EQ(incs[0].requested_bytes, 33484977464);
  // The full message, with ENOMEM's text.
  incs = Parse("RuntimeError: unable to mmap 33484977464 bytes from file <llama-65b.safetensors>: Cannot allocate "
               "memory (12)\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  EXPECT_EQ(incs[0].requested_bytes, 33484977464);
  // open-webui/open-webui#6168: Docker Compose's line for a container killed at its memory limit.
  incs = Parse("# HELP for those with \"server-1 exited with code 137\" with docker (on Mac)\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kHost);
  // In words. McGregorWwww/UDTransNet#21 (显存 grows until it bursts), NVIDIA/DALI#5293 ("Ran of GPU memory"),
  // anishathalye/neural-style#135: device memory.
  ExpectOneOomOfKind(
      IncidentKind::kDevice,
      {"# 复现\n为什么我在训练的时候显存会一直增加到爆了\n",
       "# Ran of GPU memory when using Imagenet but not COCO-Stuff 2017\n",
       "I've tried to create image with input content of size 3200x2600 pix and it returned me "
       "error that I have not enough memory on my GPU.\n"});
  // peteryuX/retinaface-tf2#18, tensorflow/tensorflow#32376, Fannovel16/ComfyUI-Frame-Interpolation#104,
  // YoumiMa/dreeam#23: host memory.
  ExpectOneOomOfKind(
      IncidentKind::kHost,
      {"I did notice that during training the cpu ram is consumed until it depletes thus silently killing the "
       "process after some time.\n",
       "# [TF2.0]Shuffle function on tf.data fills up RAM memory.\nusing `shuffle(buffer_size= #_of_elements)` it "
       "fills up shuffle buffer which also fills up RAM memory so if the data is huge and RAM is not enough then it "
       "hangs up the system which leads to system restart.\n",
       "the system RAM usage remains very high even after the task is complete and doesn't decrease, causing a "
       "DefaultCPUAllocator-Error later on.\n",
       "# The running of the step2 phase code is always killed\nIn a 4090+120GB environment, the process is always "
       "killed inexplicably, which is weird.\n"});
  // Near misses stay quiet: a mapping that failed for another reason, another exit code, a negated burst,
  // a kill that did not happen, a condition, memory filled with no failure, "ran off", a queue depleted.
  for (const char* text :
       {"RuntimeError: unable to mmap 4096 bytes from file </dev/shm/torch_1>: Invalid argument (22)\n",
        "server-1 exited with code 0\n", "app-1 exited with code 1\n", "显存没有爆掉，但是速度很慢\n",
        "内存不会爆掉，可以放心\n", "The worker is not killed when the epoch ends.\n",
        "The process was never killed by the scheduler.\n", "It is always killable with Ctrl-C.\n",
        "If there is not enough memory on the GPU, the sampler falls back to the CPU.\n",
        "The shuffle buffer fills up RAM memory before the first epoch, as intended.\n",
        "The run of GPU memory benchmarks took an hour.\n", "The program ran off the end of the list.\n",
        "Iterate until the queue is depleted.\n"}) {
    EXPECT_TRUE(Parse(text).empty()) << text;
  }
}

TEST(LogParserFormatsTest, Batch17FormatsTheParsersMissedAtFirstContact) {
  // jjang-ai/vmlx#58: MLX's Metal command buffer refused for memory is an error record, device
  // memory, though the report names the Mac's RAM.
  auto incs = Parse("# Insufficient Memory\n[error] libc++abi: terminating due to uncaught exception of type "
                    "std::runtime_error: [METAL] Command buffer execution failed: Insufficient Memory\n\nHardware:\n\n"
                    "M1 Max with 64Gb of RAM.\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
  EXPECT_EQ(incs[0].source, "report.txt:2");
  // ml-explore/mlx#3082: one buffer over Metal's largest; the request is its size.
  ExpectOneOomAsking("FAIL 5158 [metal::malloc] Attempting to allocate 86587211776 bytes which is greater than the "
                     "maximum allowed buffer size of 86586540032 bytes.\n",
                     IncidentKind::kDevice, 86587211776);
  // In words. chaofengc/PSFRGAN#34 ("memory out" for "out of memory", in its title and in its body
  // with a dangling "of"), cuiziteng/Illumination-Adaptive-Transformer#28 ("outof"): device memory.
  ExpectOneOomOfKind(IncidentKind::kDevice,
                     {"# try to train 1024 resolution memory out\nHi, this is a great code\n",
                      "use RTX 3090 24G，Train one memory out of\n",
                      "# CUDA outof memory\n3060怎么推理跑不动会直接炸，用这个模型跑视频的\n"});
  // InternLM/InternLM#55 (the process "被killed了", was killed, after the RAM grew to 21GB),
  // yangxy/PASD#18 ("the CPU memory explores", explodes misspelt): host memory.
  ExpectOneOomOfKind(IncidentKind::kHost,
                     {"模型加载到内存中，内存快速增长到21GB之后，进程被killed了，导致模型加载失败\n",
                      "# When reproducing, the CPU memory explores\nHi, thanks for your meaningful work.\n"});
  // Near misses stay quiet: other Metal failures and MLX's count of buffers, longer words after
  // "memory out", memory moved out, a kill averted or denied, "explores" with an object,
  // "outof" inside a word or with no memory after it.
  for (const char* text :
       {"[METAL] Command buffer execution failed: Caused GPU Timeout Error "
        "(00000002:kIOGPUCommandBufferCallbackErrorTimeout)\n",
        "[metal::malloc] Resource limit (499000) exceeded.\n", "Use the working memory outside the loop.\n",
        "Write the memory output to a file.\n", "See the memory outline in the docs.\n",
        "The request timed out.\n", "Swap the memory out.\n", "We page the memory out.\n",
        "进程没有被killed，可以继续训练\n", "加上这个参数以免被kill掉\n", "如果被killed了，请重启\n",
        "The episodic memory explores the state space.\n", "The agent's memory explores new states.\n",
        "The layoutof memory is shown.\n", "The code is outof date.\n"}) {
    EXPECT_TRUE(Parse(text).empty()) << text;
  }
}

TEST(LogParserFormatsTest, Batch18FormatsTheParsersMissedAtFirstContact) {
  // ggml-org/llama.cpp#9352: ggml's allocator refusing a ROCm buffer is an error record, device
  // memory, and the buffer's bytes are the request.
  auto incs = Parse("```shell\nggml_gallocr_reserve_n: failed to allocate ROCm0 buffer of size 18035509504\n"
                    "llama_new_context_with_model: failed to allocate compute buffers\n"
                    "llama_init_from_gpt_params: error: failed to create context with model "
                    "'../../../Downloads/Meta-Llama-3.1-70B-Instruct-Q4_K_L.gguf'\n"
                    "[1]    101687 segmentation fault (core dumped)  build/bin/llama-server -m  -ngl 0\n```\n");
  ASSERT_EQ(incs.size(), 1u);
  EXPECT_EQ(incs[0].kind, IncidentKind::kDevice);
  EXPECT_EQ(incs[0].source, "report.txt:2");
  EXPECT_EQ(incs[0].requested_bytes, 18035509504);
  // The same allocator's CPU buffer is host memory.
  ExpectOneOomAsking("ggml_gallocr_reserve_n: failed to allocate CPU buffer of size 2147483648\n", IncidentKind::kHost,
                     2147483648);
  // ollama/ollama#1727 (Ollama's runner died loading a model the 4 GB card could not hold) and
  // tigros/Whisperer#11 (a title naming the card's memory): device memory.
  ExpectOneOomOfKind(IncidentKind::kDevice,
                     {"# ollama doesn't use system RAM\nI'm running Ollama on a ubuntu 22 linux laptop with 32 G of "
                      "RAM and a NVIDIA gtx 1650. Very frustrating, as it exists with \"Error: llama runner exited, "
                      "you may not have enough available memory to run this model\" as soon as I try to chat...\n",
                      "# Insufficient graphics memory for this model!\nAs per object, the indicated error is shown. I "
                      "already use the \"Big\" model with other projects (e.g., Whisper).\n"});
  // qwopqwop200/GPTQ-for-LLaMa#277 (the shell's "Killed" shouted in a title), PaddlePaddle/PaddleOCR#303
  // (内存一直涨 溢出: the RAM keeps rising, overflow), huggingface/audio-transformers-course#57 (a
  // runtime crash put down to low RAM): host memory.
  ExpectOneOomOfKind(IncidentKind::kHost,
                     {"# Why does the model quantization prompt KILLED at the end?\nWhy does the model quantization "
                      "prompt KILLED at the end?\n",
                      "# 识别时内存一直涨 溢出\n进行多张图像识别时，发现内存会一直涨，没有回收。内存会到3G左右，CPU环境下。\n",
                      "# Cannot finish tasks in Colab because runtime crashes due to low RAM.\n",
                      "But the section where the feature extractor is applied to the music database, the Colab "
                      "runtime crashes saying that it crashed due to low RAM.\n"});
  // Near misses stay quiet: llama.cpp's lines for buffers it did allocate, a buffer failure with
  // no size, Ollama's runner exiting for another reason, KILLED as a state's name or denied,
  // overflow with no growth or negated, low memory without a failure or with one denied.
  for (const char* text :
       {"llama_new_context_with_model:  CUDA0 compute buffer size =   164.01 MiB\n",
        "llm_load_tensors: ROCm0 buffer size = 18035.51 MiB\n", "Creating a buffer of size 4096 for the queue.\n",
        "Error: llama runner exited with status 1\n", "Final State: KILLED\n", "The job state went to KILLED after the user's cancel.\n",
        "Application finished with status=KILLED\n", "The process was not KILLED at the end.\n",
        "Retry the task if the scheduler marks it KILLED.\n", "内存中的整数溢出会导致错误\n", "内存一直涨，但没有溢出\n",
        "The game runs slowly due to low RAM.\n", "It won't crash due to low memory any more.\n",
        "The app crashed due to low disk space on the memory card.\n"}) {
    EXPECT_TRUE(Parse(text).empty()) << text;
  }
}
TEST(LogParserFormatsTest, Batch19FormatsTheParsersMissedAtFirstContact) {
  // continuedev/continue#9668: Ollama's refusal is an error record, host memory, with its figures.
  ExpectOneOomAsking("**Error Output**\n```\n\"model requires more system memory (19.3 GiB) than is available "
                     "(14.8 GiB)\"\n```\n",
                     IncidentKind::kHost, static_cast<int64_t>(19.3 * (1LL << 30)));
  // Tangshitao/QuadTreeAttention#25 (a title "Killed！" with a full-width mark),
  // yzslab/gaussian-splatting-lightning#13 and Lightning-AI/litgpt#1181 (a kill opening a title, saying
  // when), ssbuild/chatglm_finetuning#75 (Killed inside a Chinese sentence), by2101/OpenASR#12 (内存泄露,
  // a memory leak; RAM rising until the program crashes): host memory.
  ExpectOneOomOfKind(IncidentKind::kHost,
                     {"# Killed！\n请问一下，这是正常的嘛，随着训练内存占用越来越大\n",
                      "# killed in save ply\nyour work is brilliant, but i run the code and killed in save ply\n",
                      "# Killed when saving LoRA weights\nHi All - has anyone come across this error?\n",
                      "# 推理时模型加载Killed了，有人遇到过吗，训练是没问题的\n",
                      "# 训练的时候存在内存泄露\n",
                      "随着训练，内存一直升高，直到程序崩溃。大概2小时左右崩溃\n"});
  // Near misses stay quiet: "killed" opening a line without saying when, a kill in Chinese denied
  // or averted, RAM that rose without a crash or with one denied, a crash with no growth.
  for (const char* text :
       {"Killed processes are restarted by the supervisor.\n", "killed the job myself after epoch 3.\n",
        "训练时进程没有killed，正常结束\n", "为了避免killed，我减小了batch size\n",
        "内存一直升高，但是程序没有崩溃\n", "内存占用升高了一点\n", "程序崩溃了，内存正常\n"}) {
    EXPECT_TRUE(Parse(text).empty()) << text;
  }
}

TEST(LogParserFormatsTest, Batch20FormatsTheParsersMissedAtFirstContact) {
  // clab/dynet#983 (DyNet's allocator), JingyunLiang/SwinIR#78 (Windows out of commit): error records,
  // host memory; DyNet's n is the request.
  ExpectOneOomAsking("**CPU memory allocation failed n=2097152000 align=32**\nException in thread Thread-1:\n",
                     IncidentKind::kHost, 2097152000);
  ExpectOneOomOfKind(IncidentKind::kHost,
                     {"OSError: [WinError 1455] The paging file is too small for this operation to complete.\n",
                      "**OSError: [WinError 1455] 页面文件太小，无法完成操作。**\n",
                      // chenyuntc/simple-faster-rcnn-pytorch#119, jac99/MinkLoc3Dv2#4: in words.
                      "# why i can not train ? lt always kill ?\nwho can help me ?\n",
                      "There are about 40GB RAM on my machine, but even before the first epoch finished, it already "
                      "ran out.\n"});
  // ml-explore/mlx-examples#70 (MLX's allocator), huggingface/text-generation-inference#710 (TGI's KV
  // cache): device memory.
  ExpectOneOomOfKind(IncidentKind::kDevice,
                     {"`libc++abi: terminating due to uncaught exception of type std::runtime_error: [malloc_or_wait] "
                      "Unable to allocate 12 bytes.`\n",
                      "# Not enough memory to handle 16000 total tokens with 2 prefill tokens. You need to decrease "
                      "`--max-batch-total-tokens`\n"});
  // Near misses stay quiet: the reporter killing the job, time or disk that ran out, memory that did
  // not run out, another Windows error.
  for (const char* text :
       {"I always kill the job after an hour.\n", "The RAM is fine but we ran out of time.\n",
        "The memory is plenty and the disk never ran out.\n", "The memory graph shows it ran out of disk.\n",
        "OSError: [WinError 126] The specified module could not be found.\n"}) {
    EXPECT_TRUE(Parse(text).empty()) << text;
  }
}

}  // namespace
}  // namespace oomguard::kb
