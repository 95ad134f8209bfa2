#include "core/config.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/untrusted_file.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm {
namespace {

using dnallm::testing::expect_error;

// Expects parse_config(text) to fail with exit code 2 and a message containing every needle.
void expect_usage_error(const std::string& text, const std::vector<std::string>& needles,
                        const std::vector<std::string>& overrides = {}) {
  SCOPED_TRACE(text);
  expect_error([&] { parse_config(text, "run.toml", overrides); }, ExitCode::kUsage, needles);
}

TEST(Config, DefaultsMatchDesign) {
  Config c = parse_config("", "");
  EXPECT_EQ(c.model.arch, cfg::Arch::kBert);
  EXPECT_EQ(c.model.hidden, 256);
  EXPECT_EQ(c.training.micro_batch_size, 8);
  EXPECT_EQ(c.training.precision, cfg::Precision::kFp32);
  EXPECT_DOUBLE_EQ(c.training.lr, 3e-4);
  EXPECT_EQ(c.parallel.backend, cfg::Backend::kAuto);
  EXPECT_DOUBLE_EQ(c.parallel.bucket_cap_mb, 25.0);
  EXPECT_EQ(c.parallel.accumulate_sync, cfg::AccumulateSync::kLast);
  EXPECT_EQ(c.checkpoint.resume.kind, cfg::Resume::Kind::kAuto);
  EXPECT_EQ(c.data.on_bad_record, cfg::OnBadRecord::kError);
  EXPECT_EQ(c.tokenizer.kind, cfg::TokenizerKind::kChar);
}

TEST(Config, FileValuesOverrideDefaults) {
  Config c = parse_config(R"(
[model]
arch = "gpt"
hidden = 128
heads = 2
[data]
train_files = ["a.fa.gz", "b.fa"]
[training]
lr = 1e-3
max_steps = 7
precision = "bf16"
[parallel]
bucket_cap_mb = 4   # an integer is accepted for a number
)",
                          "run.toml");
  EXPECT_EQ(c.model.arch, cfg::Arch::kGpt);
  EXPECT_EQ(c.model.hidden, 128);
  EXPECT_EQ(c.data.train_files, (std::vector<std::string>{"a.fa.gz", "b.fa"}));
  EXPECT_DOUBLE_EQ(c.training.lr, 1e-3);
  EXPECT_EQ(c.training.max_steps, 7);
  EXPECT_EQ(c.training.precision, cfg::Precision::kBf16);
  EXPECT_DOUBLE_EQ(c.parallel.bucket_cap_mb, 4.0);
  EXPECT_EQ(c.model.layers, 4);  // untouched keys keep defaults
}

TEST(Config, SetOverridesBeatFileAndTakeTomlOrBareWords) {
  Config c = parse_config(
      "[training]\nmax_steps = 7\nprecision = \"bf16\"\n", "run.toml",
      {"training.max_steps=20", "training.precision=fp32", "data.train_files=[\"x.fa\",\"y.fa\"]",
       "training.lr=3e-5", "checkpoint.dir=/tmp/run 1/ckpt", "model.gradient_checkpointing=true",
       "data.eval_files=held.fa"});
  EXPECT_EQ(c.training.max_steps, 20);
  EXPECT_EQ(c.training.precision, cfg::Precision::kFp32);
  EXPECT_EQ(c.data.train_files, (std::vector<std::string>{"x.fa", "y.fa"}));
  EXPECT_DOUBLE_EQ(c.training.lr, 3e-5);
  EXPECT_EQ(c.checkpoint.dir, "/tmp/run 1/ckpt");
  EXPECT_TRUE(c.model.gradient_checkpointing);
  EXPECT_EQ(c.data.eval_files, (std::vector<std::string>{"held.fa"}));
}

TEST(Config, HuggingFaceAliases) {
  Config c = parse_config(R"(
per_device_train_batch_size = 16
learning_rate = 5e-5
bf16 = true
[training]
gradient_accumulation_steps = 4
warmup_ratio = 0.1
lr_scheduler_type = "cosine"
max_grad_norm = 0.5
save_total_limit = 2
save_steps = 100
eval_steps = 50
logging_steps = 5
num_train_epochs = 3
max_steps = 0
seed = 7
tf32 = true
gradient_checkpointing = true
dataloader_num_workers = 3
dataloader_pin_memory = false
group_by_length = true
max_seq_length = 1024
weight_decay = 0.05
warmup_steps = 10
)",
                          "hf.toml");
  EXPECT_EQ(c.training.micro_batch_size, 16);
  EXPECT_DOUBLE_EQ(c.training.lr, 5e-5);
  EXPECT_EQ(c.training.precision, cfg::Precision::kBf16);
  EXPECT_EQ(c.training.grad_accum_steps, 4);
  EXPECT_DOUBLE_EQ(c.training.warmup_ratio, 0.1);
  EXPECT_EQ(c.training.lr_scheduler, cfg::LrScheduler::kCosine);
  EXPECT_DOUBLE_EQ(c.training.max_grad_norm, 0.5);
  EXPECT_EQ(c.checkpoint.keep_last, 2);
  EXPECT_EQ(c.checkpoint.save_steps, 100);
  EXPECT_EQ(c.training.eval_steps, 50);
  EXPECT_EQ(c.training.logging_steps, 5);
  EXPECT_DOUBLE_EQ(c.training.num_train_epochs, 3.0);
  EXPECT_EQ(c.training.seed, 7);
  EXPECT_TRUE(c.training.tf32);
  EXPECT_TRUE(c.model.gradient_checkpointing);
  EXPECT_EQ(c.data.dataloader_num_workers, 3);
  EXPECT_FALSE(c.data.pin_memory);
  EXPECT_TRUE(c.data.group_by_length);
  EXPECT_EQ(c.model.max_seq_length, 1024);
  EXPECT_DOUBLE_EQ(c.training.weight_decay, 0.05);
  EXPECT_EQ(c.training.warmup_steps, 10);
  // Aliases work in --set too, with or without a section.
  Config d = parse_config("", "", {"learning_rate=2e-4", "training.fp16=true"});
  EXPECT_DOUBLE_EQ(d.training.lr, 2e-4);
  EXPECT_EQ(d.training.precision, cfg::Precision::kFp16);
}

TEST(Config, UnknownKeyNamesKeyLineAndSuggestion) {
  expect_usage_error("[training]\n\nlearnin_rate = 1e-3\n",
                     {"run.toml:3", "training.learnin_rate", "did you mean 'learning_rate'"});
  expect_usage_error("[model]\nhiden = 64\n", {"run.toml:2", "model.hiden", "model.hidden"});
  expect_usage_error("[parallel]\nzero_stag = 1\n", {"run.toml:2", "parallel.zero_stage"});
  expect_usage_error("", {"--set", "training.max_step", "training.max_steps"},
                     {"training.max_step=3"});
}

TEST(Config, UnknownSectionSuggestsNearest) {
  expect_usage_error("[trainig]\nlr = 1e-3\n",
                     {"run.toml:1", "[trainig]", "did you mean [training]"});
}

TEST(Config, WrongTypeNamesKeyLineAndExpectedType) {
  expect_usage_error("[training]\nmax_steps = \"ten\"\n",
                     {"run.toml:2", "training.max_steps", "an integer"});
  expect_usage_error("[model]\ngradient_checkpointing = 1\n",
                     {"run.toml:2", "model.gradient_checkpointing", "true or false"});
  expect_usage_error("[data]\ntrain_files = [1, 2]\n",
                     {"run.toml:2", "data.train_files", "a list of strings"});
}

TEST(Config, OutOfRangeNamesAllowedValues) {
  expect_usage_error("[parallel]\nzero_stage = 4\n",
                     {"run.toml:2", "parallel.zero_stage", "between 0 and 3"});
  expect_usage_error("[training]\nprecision = \"fp8\"\n",
                     {"run.toml:2", "training.precision", "\"fp32\", \"bf16\", \"fp16\""});
  expect_usage_error("[training]\nmicro_batch_size = 0\n",
                     {"training.micro_batch_size", "between 1"});
  expect_usage_error("[tokenizer]\nk = 12\n", {"tokenizer.k", "between 3 and 8"});
  expect_usage_error("", {"--set parallel.backend=ucx", "\"gloo\""}, {"parallel.backend=ucx"});
}

TEST(Config, CrossKeyChecks) {
  expect_usage_error("[model]\nhidden = 100\nheads = 3\n", {"model.hidden", "model.heads"});
  expect_usage_error("[elastic]\nmin_nodes = 3\nmax_nodes = 2\n", {"elastic.min_nodes"});
  // Note [Best checkpoint]: a best model needs evaluations and a metric of the task.
  expect_usage_error("[checkpoint]\nbest_metric = \"loss\"\n",
                     {"checkpoint.best_metric", "training.eval_steps"});
  expect_usage_error("[training]\neval_steps = 10\n[checkpoint]\nbest_metric = \"mcc\"\n",
                     {"best_metric = \"mcc\"", "model.task = \"pretrain\""});
  expect_usage_error(
      "[model]\ntask = \"classification\"\n[training]\neval_steps = 10\n"
      "[checkpoint]\nbest_metric = \"bits_per_base\"\n",
      {"bits_per_base", "classification"});
  expect_usage_error("", {"best_metric", "\"mcc\""}, {"metric_for_best_model=eval_mcc"});
  const Config ok =
      parse_config("[model]\ntask = \"classification\"\n[training]\neval_steps = 10\n", "run.toml",
                   {"metric_for_best_model=mcc"});
  EXPECT_EQ(ok.checkpoint.best_metric, cfg::BestMetric::kMcc);
}

TEST(Config, MalformedTomlReportsLineAndColumn) {
  expect_usage_error("[training]\nlr = = 3\n", {"run.toml:2:", "malformed TOML"});
  expect_usage_error("[training\n", {"run.toml:1:", "malformed TOML"});
}

TEST(Config, BadSetSyntax) {
  expect_usage_error("", {"--set", "section.key=value"}, {"novalue"});
  expect_usage_error("", {"unknown section 'trainin'", "training"}, {"trainin.lr=1"});
}

TEST(Config, PrintConfigRoundTrips) {
  Config c = parse_config(R"(
[model]
arch = "gpt"
hidden = 96
heads = 3
[data]
train_files = ["with \"quotes\".fa", "back\\slash.fa"]
[training]
lr = 0.1
weight_decay = 1e-7
max_grad_norm = 0
warmup_ratio = 0.3333333333333333
)",
                          "run.toml");
  std::string text = to_toml(c);
  Config back = parse_config(text, "printed.toml");
  EXPECT_TRUE(back == c) << text;
  EXPECT_EQ(to_toml(back), text);
  // Every key appears exactly once.
  for (const auto& key : config_keys()) {
    std::string leaf = key.substr(key.find('.') + 1);
    EXPECT_NE(text.find("\n" + leaf + " = "), std::string::npos) << key;
  }
  // And a change is visible.
  back.training.lr = 0.2;
  EXPECT_FALSE(back == c);
}

// data.seq_len_warmup (Note [Sequence-length warm-up]): a list of {steps, seq_len} tables from a
// file, an array of tables or --set; printed and read back; a bad stage is exit 2 naming it.
TEST(Config, SeqLenWarmupStagesParsePrintAndAreChecked) {
  const std::vector<SeqLenStage> stages = {{100, 128}, {50, 256}};
  const Config inline_tables = parse_config(
      "[model]\nmax_seq_length = 1024\n[data]\n"
      "seq_len_warmup = [{steps = 100, seq_len = 128}, {seq_len = 256, steps = 50}]\n",
      "run.toml");
  EXPECT_EQ(inline_tables.data.seq_len_warmup, stages);
  const Config array_of_tables = parse_config(
      "[model]\nmax_seq_length = 1024\n[[data.seq_len_warmup]]\nsteps = 100\nseq_len = 128\n"
      "[[data.seq_len_warmup]]\nsteps = 50\nseq_len = 256\n",
      "run.toml");
  EXPECT_EQ(array_of_tables.data.seq_len_warmup, stages);
  const Config set =
      parse_config("", "run.toml",
                   {"model.max_seq_length=1024",
                    "data.seq_len_warmup=[{steps=100,seq_len=128},{steps=50,seq_len=256}]"});
  EXPECT_EQ(set.data.seq_len_warmup, stages);
  const std::string text = to_toml(set);
  EXPECT_NE(
      text.find("seq_len_warmup = [{steps = 100, seq_len = 128}, {steps = 50, seq_len = 256}]"),
      std::string::npos)
      << text;
  EXPECT_TRUE(parse_config(text, "printed.toml") == set);
  EXPECT_TRUE(Config().data.seq_len_warmup.empty());

  const std::string max = "[model]\nmax_seq_length = 64\n[data]\nseq_len_warmup = ";
  expect_usage_error(max + "[{steps = 2, seq_len = 32}, {steps = 2, seq_len = 16}]\n",
                     {"data.seq_len_warmup[1].seq_len = 16", "longer than the stage before"});
  expect_usage_error(max + "[{steps = 2, seq_len = 32}, {steps = 2, seq_len = 32}]\n",
                     {"data.seq_len_warmup[1].seq_len = 32", "longer than the stage before"});
  expect_usage_error(max + "[{steps = 2, seq_len = 24}]\n",
                     {"data.seq_len_warmup[0].seq_len = 24", "must divide model.max_seq_length"});
  expect_usage_error(max + "[{steps = 2, seq_len = 128}]\n",
                     {"data.seq_len_warmup[0].seq_len = 128", "shorter than model.max_seq_length"});
  expect_usage_error(max + "[{steps = 0, seq_len = 16}]\n",
                     {"run.toml:4", "data.seq_len_warmup[0].steps is 0"});
  expect_usage_error(max + "[{steps = 2}]\n", {"data.seq_len_warmup[0] needs both keys"});
  expect_usage_error(max + "[{steps = 2, seq_len = 16, rows = 4}]\n",
                     {"data.seq_len_warmup[0]", "unknown key 'rows'"});
  expect_usage_error(max + "[16, 32]\n", {"data.seq_len_warmup", "{steps = N, seq_len = N}"});
  expect_usage_error(max + "[{steps = 2, seq_len = 16}]\n", {"pre-training"},
                     {"model.task=classification"});
}

TEST(Config, ModelHashIgnoresTrainingKnobs) {
  Config a = parse_config("", "");
  Config b = parse_config("", "", {"training.lr=1e-2", "checkpoint.dir=elsewhere"});
  Config d = parse_config("", "", {"model.layers=5"});
  EXPECT_EQ(model_config_hash(a), model_config_hash(b));
  EXPECT_NE(model_config_hash(a), model_config_hash(d));
  // A key added later joins the hash only when set (Note [Model hash across releases]):
  // configs/quickstart.toml hashed to de934a2fff92763d in the checkpoints written before
  // lora.quantize_base, model.kv_heads, model.mlp and model.post_layer_norm existed, and such
  // checkpoints must still resume.
  Config q = load_config(std::string(DNALLM_SOURCE_DIR) + "/configs/quickstart.toml");
  EXPECT_EQ(fmt::format("{:016x}", model_config_hash(q)), "de934a2fff92763d");
  Config nf4 = q;
  nf4.lora.quantize_base = cfg::QuantizeBase::kNf4;
  EXPECT_NE(model_config_hash(nf4), model_config_hash(q));
  Config grouped = q;
  grouped.model.kv_heads = 1;
  EXPECT_NE(model_config_hash(grouped), model_config_hash(q));
  Config geglu = q;
  geglu.model.mlp = cfg::Mlp::kGeglu;
  EXPECT_NE(model_config_hash(geglu), model_config_hash(q));
  Config post_ln = q;
  post_ln.model.post_layer_norm = true;
  EXPECT_NE(model_config_hash(post_ln), model_config_hash(q));
}

TEST(Config, LoadFileErrors) {
  expect_error([&] { load_config("/nonexistent/run.toml"); }, ExitCode::kUsage,
               {"/nonexistent/run.toml"});
  std::string path = ::testing::TempDir() + "/empty.toml";
  { std::ofstream(path) << ""; }
  EXPECT_TRUE(load_config(path) == parse_config("", ""));
}

TEST(Config, ADirectoryAsConfigIsAUsageErrorNotDefaults) {
  const std::string dir = ::testing::TempDir() + "/config_is_a_dir";
  std::filesystem::create_directories(dir);
  expect_error([&] { load_config(dir); }, ExitCode::kUsage, {"is a directory"});
}

TEST(Config, AnAliasAndItsKeyInOneTableNameBoth) {
  // Issue 22: `lr` and `learning_rate` in one table (the later silently won).
  expect_usage_error(
      "[training]\nlr = 1e-3\nlearning_rate = 5e-5\n",
      {"run.toml:3", "'learning_rate' and 'lr'", "run.toml:2", "training.lr", "keep one"});
  expect_usage_error("[training]\nlearning_rate = 1e-3\nlr = 5e-5\n",
                     {"run.toml:3: 'lr' and 'learning_rate' (run.toml:2)"});
  expect_usage_error(
      "[training]\nsave_steps = 5\n[checkpoint]\nsave_steps = 5\nsave_total_limit = 2\nkeep_last = "
      "3\n",
      {"'keep_last' and 'save_total_limit'", "checkpoint.keep_last"});
  // In different tables, or the bf16/fp16 selectors together: accepted as before.
  EXPECT_DOUBLE_EQ(
      parse_config("learning_rate = 1e-3\n[training]\nlr = 5e-5\n", "run.toml").training.lr, 5e-5);
  EXPECT_EQ(parse_config("[training]\nbf16 = false\nfp16 = false\n", "run.toml").training.precision,
            cfg::Precision::kFp32);
}

TEST(Config, ConfigFilesAreBoundedAndRegular) {
  // Issue 22: --config /dev/zero read 2.2 GB before failing.
  for (const std::string path : {"/dev/zero", "/dev/null"}) {
    SCOPED_TRACE(path);
    expect_error([&] { load_config(path); }, ExitCode::kUsage,
                 {"is not a regular file (a device)"});
  }
  const std::string dir = ::testing::TempDir() + "/config_bounds";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string big = dir + "/big.toml";
  { std::ofstream(big) << "# big\n"; }
  std::filesystem::resize_file(big, kMaxConfigFileBytes + 1);
  const std::string loop = dir + "/loop.toml";
  std::filesystem::create_symlink(loop, loop);
  for (const auto& [path, needle] : std::vector<std::pair<std::string, std::string>>{
           {big, "more than the 16777216 bytes allowed"}, {loop, "symbolic link loop"}}) {
    try {
      load_config(path);
      FAIL() << path << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
  std::filesystem::remove_all(dir);
}

TEST(Config, AdamEpsilonZeroIsRefused) {
  expect_error([&] { parse_config("[training]\nadam_epsilon = 0\n", "run.toml"); },
               ExitCode::kUsage, {"adam_epsilon", "run.toml"});
  EXPECT_NO_THROW(parse_config("[training]\nadam_epsilon = 1e-12\n", "run.toml"));
}

TEST(Config, AllocationFailuresBecomeOneSentence) {
  const std::string torch_cpu =
      "[enforce fail at alloc_cpu.cpp:75] err == 0. DefaultCPUAllocator: can't allocate memory: "
      "you tried to allocate 1099511627776 bytes. Error code 12 (Cannot allocate memory)\n"
      "frame #0: c10::ThrowEnforceNotMet(...)\nframe #1: ...";
  auto first = allocation_failure(torch_cpu);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->find("frame #"), std::string::npos) << *first;
  EXPECT_NE(first->find("1099511627776 bytes"), std::string::npos) << *first;
  EXPECT_TRUE(allocation_failure("CUDA out of memory. Tried to allocate 20.00 GiB").has_value());
  EXPECT_FALSE(allocation_failure("shape mismatch in linear").has_value());
  const std::string msg = out_of_memory_message(*first);
  EXPECT_NE(msg.find("training.micro_batch_size"), std::string::npos);
  EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(Config, BundledPresetsLoad) {
  for (const char* name :
       {"quickstart.toml", "bench-cpu.toml", "pretrain-small.toml", "finetune-lora-cpu.toml",
        "pretrain-gpt-cpu.toml", "gue-finetune.toml"}) {
    std::string path = std::string(DNALLM_SOURCE_DIR) + "/configs/" + name;
    EXPECT_NO_THROW(load_config(path)) << path;
  }
  Config bench = load_config(std::string(DNALLM_SOURCE_DIR) + "/configs/bench-cpu.toml");
  // The bench-cpu shape is a contract (issue: keep exactly this shape).
  EXPECT_EQ(bench.model.arch, cfg::Arch::kBert);
  EXPECT_EQ(bench.tokenizer.kind, cfg::TokenizerKind::kChar);
  EXPECT_EQ(bench.model.hidden, 256);
  EXPECT_EQ(bench.model.layers, 4);
  EXPECT_EQ(bench.model.heads, 4);
  EXPECT_EQ(bench.model.ffn, 1024);
  EXPECT_EQ(bench.model.position, cfg::Position::kLearned);
  EXPECT_EQ(bench.model.max_seq_length, 512);
  EXPECT_EQ(bench.training.micro_batch_size, 8);
  EXPECT_EQ(bench.training.precision, cfg::Precision::kFp32);
  EXPECT_DOUBLE_EQ(bench.training.lr, 3e-4);
  EXPECT_DOUBLE_EQ(bench.data.mlm_probability, 0.15);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(ConfigReference, DocsMatchTheSchema) {
  const std::string src = DNALLM_SOURCE_DIR;
  const std::string page_template = read_text(src + "/docs/config.md.in");
  ASSERT_FALSE(page_template.empty()) << src << "/docs/config.md.in";
  const std::string rendered = config_reference(page_template);
  const std::string committed = read_text(src + "/docs/config.md");
  if (rendered == committed) return;
  // Name the first line that differs, then how to fix it.
  const auto want = [&] {
    std::vector<std::string> lines;
    std::stringstream ss(rendered);
    for (std::string l; std::getline(ss, l);) lines.push_back(l);
    return lines;
  }();
  std::stringstream have(committed);
  size_t n = 0;
  std::string line;
  while (std::getline(have, line) && n < want.size() && line == want[n]) ++n;
  ADD_FAILURE() << "docs/config.md differs from the schema (core/config/) and "
                   "docs/config.md.in, first at line "
                << n + 1 << ":\n  docs/config.md: " << (n < want.size() ? line : "(end)")
                << "\n  rendered:       " << (n < want.size() ? want[n] : "(end)")
                << "\nRegenerate it: cmake --build build --target config-reference";
}

TEST(ConfigReference, EveryKeyHasADefaultAndAMeaning) {
  const std::string keys = config_reference("{{aliases}}{{keys}}");
  for (const auto& full : config_keys()) {
    const std::string name = full.substr(full.find('.') + 1);
    const std::string section = full.substr(0, full.find('.'));
    const auto table = keys.find("### [" + section + "]");
    ASSERT_NE(table, std::string::npos) << section;
    const auto row = keys.find("| `" + name + "` | `", table);
    ASSERT_NE(row, std::string::npos) << full;
    const std::string text = keys.substr(row, keys.find('\n', row) - row);
    // | key | default | allowed | meaning |: the meaning is the last cell, not empty.
    const auto last = text.rfind(" | ", text.size() - 3);
    ASSERT_NE(last, std::string::npos) << text;
    EXPECT_GT(text.size() - last, std::string(" |  |").size()) << "no meaning for " << full;
  }
  EXPECT_NE(keys.find("| `learning_rate` | `training.lr` |"), std::string::npos) << keys;
  EXPECT_NE(keys.find("| `heads` | `4` | integer, between 1 and 1024 |"), std::string::npos);
  EXPECT_NE(keys.find("| `arch` | `\"bert\"` | `\"bert\"` \\| `\"gpt\"` \\| `\"hyena\"` \\| "
                      "`\"caduceus\"` \\| `\"caduceus-ps\"` |"),
            std::string::npos);
}

TEST(ConfigReference, AMissingMarkerIsAnError) {
  EXPECT_THROW(config_reference("no markers"), Error);
  EXPECT_THROW(config_reference("{{keys}} only"), Error);
}

TEST(Config, KeyOverridesNameTheirOrigin) {
  Config c = parse_config("[elastic]\nmax_restarts = 5\n", "run.toml");
  EXPECT_EQ(c.elastic.max_restarts, 5);
  apply_key_overrides(c, {{"elastic.max_restarts", "2", "--max-restarts 2"},
                          {"elastic.settle_s", "0.5", "--rdzv-settle 0.5"}});
  EXPECT_EQ(c.elastic.max_restarts, 2);
  EXPECT_DOUBLE_EQ(c.elastic.settle_s, 0.5);
  expect_error(
      [&] {
        apply_key_overrides(c, {{"elastic.max_restarts", "-1", "--max-restarts -1"}});
      },
      ExitCode::kUsage, {"--max-restarts -1", "between 0 and"});
  // The whole configuration is checked again: min_nodes above max_nodes.
  EXPECT_THROW(apply_key_overrides(c, {{"elastic.min_nodes", "3", "--nnodes 3:2"},
                                       {"elastic.max_nodes", "2", "--nnodes 3:2"}}),
               Error);
}

TEST(Config, DefaultsAreTheSchemasToo) {
  EXPECT_EQ(config_default("elastic.max_restarts"), std::to_string(ElasticConfig{}.max_restarts));
  EXPECT_EQ(config_default("elastic.settle_s"), "2.0");
  EXPECT_EQ(config_default("model.arch"), "\"bert\"");
  EXPECT_THROW(config_default("elastic.nope"), Error);
}

// Note [Config choices]: every closed-choice key with its spellings, written out here (not
// taken from the schema) so that a spelling dropped or renamed in the table fails; `field`
// reads the key back through its enum.
struct ChoiceKey {
  std::string key;
  std::vector<std::string> spellings;
  std::function<std::string(const Config&)> field;
  std::vector<std::string> needs = {};  // other --set values that make each spelling valid
};

std::vector<ChoiceKey> choice_keys() {
  return {
      {"model.arch",
       {"bert", "gpt", "hyena", "caduceus", "caduceus-ps"},
       [](const Config& c) { return cfg::spelling(c.model.arch); }},
      {"model.task",
       {"pretrain", "classification", "regression"},
       [](const Config& c) { return cfg::spelling(c.model.task); }},
      {"model.position",
       {"learned", "rotary", "alibi"},
       [](const Config& c) { return cfg::spelling(c.model.position); }},
      {"model.mlp", {"gelu", "geglu"}, [](const Config& c) { return cfg::spelling(c.model.mlp); }},
      {"model.attn_implementation",
       {"auto", "sdpa", "eager"},
       [](const Config& c) { return cfg::spelling(c.model.attn_implementation); }},
      {"model.pooling",
       {"cls", "mean"},
       [](const Config& c) { return cfg::spelling(c.model.pooling); }},
      {"lora.quantize_base",
       {"none", "nf4"},
       [](const Config& c) { return cfg::spelling(c.lora.quantize_base); }},
      {"tokenizer.kind",
       {"char", "kmer", "nt", "bpe", "hf"},
       [](const Config& c) { return cfg::spelling(c.tokenizer.kind); }},
      {"data.format",
       {"auto", "fasta", "fastq", "csv", "tsv", "jsonl"},
       [](const Config& c) { return cfg::spelling(c.data.format); }},
      {"data.on_bad_record",
       {"error", "skip"},
       [](const Config& c) { return cfg::spelling(c.data.on_bad_record); }},
      {"data.sampling",
       {"random", "tile"},
       [](const Config& c) { return cfg::spelling(c.data.sampling); }},
      {"data.n_policy",
       {"skip", "mask"},
       [](const Config& c) { return cfg::spelling(c.data.n_policy); }},
      {"training.batch_size",
       {"", "auto"},
       [](const Config& c) { return cfg::spelling(c.training.batch_size); }},
      {"training.lr_scheduler",
       {"constant", "linear", "cosine"},
       [](const Config& c) { return cfg::spelling(c.training.lr_scheduler); }},
      {"training.precision",
       {"fp32", "bf16", "fp16"},
       [](const Config& c) { return cfg::spelling(c.training.precision); }},
      {"training.sync_free",
       {"auto", "on", "off"},
       [](const Config& c) { return cfg::spelling(c.training.sync_free); }},
      {"training.device",
       {"auto", "cpu", "cuda"},
       [](const Config& c) { return cfg::spelling(c.training.device); }},
      {"parallel.backend",
       {"auto", "gloo", "mpi", "nccl"},
       [](const Config& c) { return cfg::spelling(c.parallel.backend); }},
      {"parallel.accumulate_sync",
       {"last", "every"},
       [](const Config& c) { return cfg::spelling(c.parallel.accumulate_sync); }},
      {"parallel.grad_reduce_dtype",
       {"fp32", "bf16", "fp16"},
       [](const Config& c) { return cfg::spelling(c.parallel.grad_reduce_dtype); }},
      {"checkpoint.compression",
       {"zstd", "none"},
       [](const Config& c) { return cfg::spelling(c.checkpoint.compression); }},
      {"checkpoint.best_metric",
       {"none", "loss", "bits_per_base", "accuracy", "mcc", "f1"},
       [](const Config& c) { return cfg::spelling(c.checkpoint.best_metric); },
       {"training.eval_steps=10", "model.task=classification"}},
      {"logging.level",
       {"trace", "debug", "info", "warn", "error", "critical", "off"},
       [](const Config& c) { return cfg::spelling(c.logging.level); }},
  };
}

TEST(ConfigChoices, EverySpellingRoundTripsThroughParseAndToml) {
  for (const auto& k : choice_keys()) {
    for (const auto& spelling : k.spellings) {
      std::vector<std::string> sets = k.needs;
      // bits_per_base scores a language model: not with the classification task above.
      if (spelling == "bits_per_base") sets = {"training.eval_steps=10"};
      sets.push_back(k.key + "=\"" + spelling + "\"");
      const Config c = parse_config("", "run.toml", sets);
      EXPECT_EQ(k.field(c), spelling) << k.key;
      const std::string toml = to_toml(c);
      const std::string name = k.key.substr(k.key.find('.') + 1);
      EXPECT_NE(toml.find("\n" + name + " = \"" + spelling + "\"\n"), std::string::npos)
          << k.key << " = " << spelling << " in:\n"
          << toml;
      const Config back = parse_config(toml, "round-trip");
      EXPECT_EQ(k.field(back), spelling) << k.key;
      EXPECT_TRUE(back == c) << k.key << " = " << spelling;
    }
  }
}

TEST(ConfigChoices, UnknownSpellingNamesKeyValueAndAllowedSpellings) {
  for (const auto& k : choice_keys()) {
    std::string allowed;
    for (const auto& s : k.spellings) allowed += (allowed.empty() ? "\"" : ", \"") + s + "\"";
    const std::string name = k.key.substr(k.key.find('.') + 1);
    const std::string section = k.key.substr(0, k.key.find('.'));
    // In a file (file:line) and in --set, as the other keys' messages do.
    expect_usage_error(
        "[" + section + "]\n" + name + " = \"bogus\"\n",
        {"run.toml:2", "key '" + k.key + "' is \"bogus\"", "allowed values are " + allowed});
    expect_usage_error("", {"--set " + k.key + "=bogus", "\"bogus\"", allowed}, {k.key + "=bogus"});
    // A wrong type names the allowed spellings too.
    expect_usage_error("[" + section + "]\n" + name + " = 3\n",
                       {"run.toml:2", k.key, "a string (one of " + allowed + ")"});
  }
}

TEST(ConfigChoices, ResumeIsAutoNoneOrAPath) {
  const Config a = parse_config("", "run.toml");
  EXPECT_EQ(a.checkpoint.resume.kind, cfg::Resume::Kind::kAuto);
  const Config n = parse_config("", "run.toml", {"checkpoint.resume=none"});
  EXPECT_EQ(n.checkpoint.resume.kind, cfg::Resume::Kind::kNone);
  const Config p = parse_config("", "run.toml", {"checkpoint.resume=\"ckpt/step_000000002\""});
  EXPECT_EQ(p.checkpoint.resume.kind, cfg::Resume::Kind::kPath);
  EXPECT_EQ(p.checkpoint.resume.path, "ckpt/step_000000002");
  for (const Config* c : {&a, &n, &p}) {
    const Config back = parse_config(to_toml(*c), "round-trip");
    EXPECT_EQ(back.checkpoint.resume.kind, c->checkpoint.resume.kind);
    EXPECT_EQ(back.checkpoint.resume.path, c->checkpoint.resume.path);
    EXPECT_EQ(cfg::spelling(back.checkpoint.resume), cfg::spelling(c->checkpoint.resume));
  }
  EXPECT_NE(to_toml(p).find("\nresume = \"ckpt/step_000000002\"\n"), std::string::npos);
  EXPECT_NE(to_toml(n).find("\nresume = \"none\"\n"), std::string::npos);
}

TEST(ConfigChoices, PrecisionDecodesToOneDType) {
  EXPECT_EQ(cfg::dtype_of(cfg::Precision::kFp32), DType::kFloat32);
  EXPECT_EQ(cfg::dtype_of(cfg::Precision::kBf16), DType::kBFloat16);
  EXPECT_EQ(cfg::dtype_of(cfg::Precision::kFp16), DType::kFloat16);
}

}  // namespace
}  // namespace dnallm
