// The fine-tuning demo from a Hugging Face directory, end to end with the real binaries:
// dnallm-launch --nproc-per-node 2 LoRA-fine-tunes the DNABERT-style fixture (post-LN BERT,
// 3-mer vocab.txt) into a classifier over Gloo, writes TensorBoard events (read back here by
// the format's rules and compared with the metrics JSON lines) and exports final/hf
// (transformers layout: the merged model, the PEFT adapter and its base), whose adapter
// logits equal the merged model's through dnallm-eval --logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "core/tensorboard.hpp"
#include "tests/support/process.hpp"

namespace {

namespace fs = std::filesystem;
using dnallm::testing::kBin;
using dnallm::testing::kSrc;

using dnallm::testing::run_shell;

// The values of tensor `name` (float32 or int64, as T) of a safetensors file.
template <typename T>
std::vector<T> values(const std::string& path, const std::string& name) {
  const auto file = dnallm::checkpoint::read_safetensors_header(path);
  const auto& e = file.tensors.at(name);
  std::vector<T> v((e.data_end - e.data_begin) / sizeof(T));
  std::ifstream f(path, std::ios::binary);
  f.seekg(static_cast<std::streamoff>(file.data_offset + e.data_begin));
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}
std::vector<float> floats(const std::string& path, const std::string& name) {
  return values<float>(path, name);
}

// dnallm-eval --logits: the logits of the model in `model` on the lines of `seqs`, into `out`.
dnallm::testing::CommandResult eval_logits(const std::string& model, const std::string& seqs,
                                           const std::string& out) {
  return run_shell(kBin + "dnallm-eval --model " + model + " --logits " + seqs + " --out " + out);
}

// The step lines of a metrics file (its lines without an "event").
std::vector<nlohmann::json> step_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("event")) out.push_back(std::move(j));
  }
  return out;
}

// Every step line of a metrics file logged a finite loss; returns how many there are.
int steps_with_finite_loss(const std::string& path) {
  const auto steps = step_lines(path);
  for (const auto& j : steps) EXPECT_TRUE(std::isfinite(j.at("loss").get<double>())) << j.dump();
  return static_cast<int>(steps.size());
}

TEST(HfFineTune, LoraFromDnabertDirectoryWithTwoWorkers) {
  const auto dir = fs::temp_directory_path() / ("dnallm_hf_finetune_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // Windows of the genome (label 0) vs the same windows with every A turned into C (label 1).
  const std::string genome = dnallm::testing::bundled_genome(200000);
  dnallm::testing::write_composition_table((dir / "train.csv").string(), genome, 0, 64);
  dnallm::testing::write_composition_table((dir / "eval.csv").string(), genome, 100000, 64);
  const auto ck = (dir / "ck").string();
  const auto tb = (dir / "tb").string();
  auto train = run_shell(
      "cd " + kSrc + " && " + kBin + "dnallm-launch --nproc-per-node 2 --config " +
      "configs/finetune-hf-dnabert.toml --set model.max_seq_length=64" +
      " --set 'data.train_files=[\"" + (dir / "train.csv").string() + "\"]'" +
      " --set 'data.eval_files=[\"" + (dir / "eval.csv").string() + "\"]'" +
      " --set training.max_steps=40 --set training.micro_batch_size=8 --set training.lr=1e-2" +
      " --set training.eval_steps=20 --set training.logging_steps=5 --set parallel.backend=gloo" +
      " --set checkpoint.dir=" + ck + " --set logging.tensorboard_dir=" + tb + " --metrics-file " +
      ck + "/metrics.jsonl");
  ASSERT_EQ(train.code, 0) << train.out;
  EXPECT_NE(train.out.find("from the Hugging Face BertForSequenceClassification"),
            std::string::npos)
      << train.out;

  // [tokenizer] must tokenize as the directory does: one token a base is refused (exit 2)
  // with the settings that would match.
  auto wrong =
      run_shell("cd " + kSrc + " && " + kBin + "dnallm-train --config " +
                "configs/finetune-hf-dnabert.toml --set model.max_seq_length=64" +
                " --set tokenizer.kind=char --set 'data.train_files=[\"" +
                (dir / "train.csv").string() + "\"]' --set 'data.eval_files=[\"" +
                (dir / "eval.csv").string() + "\"]' --set checkpoint.dir=" + ck + "_wrong");
  EXPECT_EQ(wrong.code, 2) << wrong.out;
  EXPECT_NE(wrong.out.find("tokenizer.k = 3"), std::string::npos) << wrong.out;

  auto scored = run_shell(kBin + "dnallm-eval --model " + ck + "/final --table " +
                          (dir / "eval.csv").string() + " 2>/dev/null");
  ASSERT_EQ(scored.code, 0) << scored.out;
  auto c = nlohmann::json::parse(scored.out);
  EXPECT_EQ(c.at("rows").get<int64_t>(), 64);
  EXPECT_GE(c.at("accuracy").get<double>(), 0.8) << scored.out;

  // The transformers export: a post-LN BERT goes out as bert, the adapter in PEFT's format.
  const auto hf = ck + "/final/hf";
  nlohmann::json config = nlohmann::json::parse(std::ifstream(hf + "/config.json"));
  EXPECT_EQ(config.at("model_type"), "bert");
  EXPECT_EQ(config.at("architectures").at(0), "BertForSequenceClassification");
  nlohmann::json adapter =
      nlohmann::json::parse(std::ifstream(hf + "/adapter/adapter_config.json"));
  EXPECT_EQ(adapter.at("peft_type"), "LORA");
  EXPECT_EQ(adapter.at("r"), 8);
  const auto seqs = (dir / "seqs.txt").string();
  std::ofstream(seqs) << genome.substr(5000, 60) << "\n" << genome.substr(7000, 45) << "\n";
  const auto merged = (dir / "merged.safetensors").string();
  const auto adapted = (dir / "adapted.safetensors").string();
  ASSERT_EQ(eval_logits(hf, seqs, merged).code, 0);
  auto with_adapter = run_shell(kBin + "dnallm-eval --model " + hf + "/base --adapter " + hf +
                                "/adapter --logits " + seqs + " --out " + adapted);
  ASSERT_EQ(with_adapter.code, 0) << with_adapter.out;
  // Our own export (final/, our tokenizer) = its transformers export (final/hf) = PEFT's adapter
  // on its base = its merge.
  const auto own = (dir / "own.safetensors").string();
  ASSERT_EQ(eval_logits(ck + "/final", seqs, own).code, 0);
  const auto full = floats(merged, "logits");
  const auto ours = floats(own, "logits");
  ASSERT_EQ(ours.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) EXPECT_NEAR(ours[i], full[i], 1e-4) << i;
  const auto via_adapter = floats(adapted, "logits");
  const auto via_merge = floats(adapted, "merged_logits");
  ASSERT_EQ(full.size(), 4u);  // 2 sequences x 2 labels
  ASSERT_EQ(via_adapter.size(), full.size());
  for (size_t i = 0; i < full.size(); ++i) {
    EXPECT_NEAR(via_adapter[i], full[i], 1e-4) << i;
    EXPECT_NEAR(via_merge[i], full[i], 1e-4) << i;
  }

  // TensorBoard: every step line of the metrics file is an event with the same numbers.
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(tb)) files.push_back(e.path());
  ASSERT_EQ(files.size(), 1u);
  const auto events = dnallm::read_event_file(files[0].string());
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  std::map<int64_t, float> tb_loss;
  bool saw_eval = false;
  for (const auto& e : events) {
    for (const auto& [tag, value] : e.scalars) {
      if (tag == "train/loss") tb_loss[e.step] = value;
      if (tag == "eval/accuracy") saw_eval = true;
    }
  }
  EXPECT_TRUE(saw_eval);
  const auto steps = step_lines(ck + "/metrics.jsonl");
  for (const auto& j : steps) {
    const auto step = j.at("step").get<int64_t>();
    ASSERT_TRUE(tb_loss.count(step)) << "step " << step << " missing from the event file";
    EXPECT_EQ(tb_loss[step], static_cast<float>(j.at("loss").get<double>()));
  }
  EXPECT_GE(steps.size(), 8u);
  EXPECT_EQ(tb_loss.size(), steps.size());
  fs::remove_all(dir);
}

// Continued masked-LM pre-training from a Nucleotide-Transformer-style fixture (6-mer
// vocab.txt) on the bundled genome with tokenizer.kind = "nt", and the export goes back out as
// esm (with the remote code's auto_map for v2).
void continued_pretraining_with_the_nt_split(const std::string& family) {
  const auto ck =
      fs::temp_directory_path() / ("dnallm_hf_" + family + "_" + std::to_string(::getpid()));
  fs::remove_all(ck);
  auto train = run_shell(
      "cd " + kSrc + " && " + kBin + "dnallm-train --config configs/quickstart.toml" +
      " --set model.init_from=tests/data/hf-fixtures/" + family + " --set tokenizer.kind=nt" +
      " --set tokenizer.k=6 --set model.max_seq_length=32 --set training.max_steps=6" +
      " --set training.eval_steps=6 --set training.logging_steps=1" +
      " --set checkpoint.save_steps=0 --set checkpoint.dir=" + ck.string() + " --metrics-file " +
      (ck / "metrics.jsonl").string());
  ASSERT_EQ(train.code, 0) << train.out;
  EXPECT_NE(train.out.find("from the Hugging Face EsmForMaskedLM"), std::string::npos) << train.out;
  nlohmann::json config = nlohmann::json::parse(std::ifstream(ck / "final/hf/config.json"));
  EXPECT_EQ(config.at("model_type"), "esm");
  const auto theirs = nlohmann::json::parse(
      std::ifstream(kSrc + "/tests/data/hf-fixtures/" + family + "/config.json"));
  EXPECT_EQ(config.value("auto_map", nlohmann::json()), theirs.value("auto_map", nlohmann::json()));
  EXPECT_EQ(config.value("position_embedding_type", ""), theirs.at("position_embedding_type"));
  // Our export (our tokenizer) and its esm export (EsmTokenizer's vocab.txt) give the same ids
  // and logits (sequences of one length: no padding, where ESM zeroes embeddings).
  const auto seqs = (ck / "seqs.txt").string();
  std::ofstream(seqs) << "ACGTACGTTAGCCGATAGGCTTACGATCGATCGGATCCATGCAAGTCNNACGTTGCA\n"
                      << "TTGACAGCTAGCTCAGTCCTAGGTATAATGCTAGCACGTAGCTAGCAGTCAGTACGA\n";
  const auto own = (ck / "own.safetensors").string(), hf = (ck / "hf.safetensors").string();
  ASSERT_EQ(eval_logits((ck / "final").string(), seqs, own).code, 0);
  ASSERT_EQ(eval_logits((ck / "final/hf").string(), seqs, hf).code, 0);
  EXPECT_EQ(values<int64_t>(own, "input_ids"), values<int64_t>(hf, "input_ids"));
  const auto a = floats(own, "logits"), b = floats(hf, "logits");
  ASSERT_EQ(a.size(), b.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, double(std::fabs(a[i] - b[i])));
  EXPECT_LE(worst, 1e-4);
  // Every step logged a finite loss (the import's exactness is worker_hf_import_test's).
  EXPECT_EQ(steps_with_finite_loss((ck / "metrics.jsonl").string()), 6);
  fs::remove_all(ck);
}

// DNABERT-2 end to end: a DNABERT-2-shaped model pre-trained from scratch
// (configs/dnabert2-tiny.toml: ALiBi, post-LN, GEGLU, 6 heads) goes out in DNABERT-2's layout
// (final/hf: auto_map, fused Wqkv) computing what final/ computes; that directory is then a
// DNABERT-2 model.init_from for LoRA under dnallm-launch --nproc-per-node 2 and for full
// fine-tuning, and the classifiers score, embed and predict.
TEST(HfFineTune, Dnabert2PretrainExportThenLoraAndFullFineTune) {
  const auto dir = fs::temp_directory_path() / ("dnallm_hf_dnabert2_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto pre = (dir / "pre").string();
  auto pretrain =
      run_shell("cd " + kSrc + " && " + kBin + "dnallm-train --config " +
                "configs/dnabert2-tiny.toml --set training.max_steps=4" +
                " --set checkpoint.dir=" + pre + " --metrics-file " + pre + "/metrics.jsonl");
  ASSERT_EQ(pretrain.code, 0) << pretrain.out;
  const auto hf = pre + "/final/hf";
  nlohmann::json config = nlohmann::json::parse(std::ifstream(hf + "/config.json"));
  EXPECT_EQ(config.at("model_type"), "bert");
  EXPECT_EQ(config.at("architectures").at(0), "BertForMaskedLM");
  EXPECT_EQ(config.at("auto_map").at("AutoModelForMaskedLM"),
            "zhihan1996/DNABERT-2-117M--bert_layers.BertForMaskedLM");
  const auto header = dnallm::checkpoint::read_safetensors_header(hf + "/model.safetensors");
  EXPECT_TRUE(header.tensors.count("bert.encoder.layer.1.attention.self.Wqkv.weight"));
  EXPECT_TRUE(header.tensors.count("bert.encoder.layer.1.mlp.gated_layers.weight"));
  // final/ and its DNABERT-2 export compute the same logits, on sequences longer than any
  // table (ALiBi: 200 bases on a model trained at 128).
  const std::string genome = dnallm::testing::bundled_genome(200000);
  const auto seqs = (dir / "seqs.txt").string();
  std::ofstream(seqs) << genome.substr(5000, 200) << "\n" << genome.substr(9000, 70) << "\n";
  const auto own = (dir / "own.safetensors").string(), out = (dir / "hf.safetensors").string();
  auto own_run = eval_logits(hf, seqs, out);
  ASSERT_EQ(own_run.code, 0) << own_run.out;
  std::ofstream(dir / "short.txt") << genome.substr(5000, 100) << "\n"
                                   << genome.substr(9000, 70) << "\n";
  const auto short_seqs = (dir / "short.txt").string();
  const auto hf_short = (dir / "hf_short.safetensors").string();
  ASSERT_EQ(eval_logits(pre + "/final", short_seqs, own).code, 0);
  ASSERT_EQ(eval_logits(hf, short_seqs, hf_short).code, 0);
  const auto mask = values<int64_t>(own, "attention_mask");
  const auto a = floats(own, "logits"), b = floats(hf_short, "logits");
  ASSERT_EQ(a.size(), b.size());
  const size_t vocab = a.size() / mask.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (mask[i / vocab] == 1) {
      EXPECT_NEAR(a[i], b[i], 1e-4) << i;
    }
  }

  dnallm::testing::write_composition_table((dir / "train.csv").string(), genome, 0, 64);
  dnallm::testing::write_composition_table((dir / "eval.csv").string(), genome, 100000, 64);
  const std::string finetune =
      " --config configs/finetune-hf-dnabert.toml --set model.init_from=" + hf +
      " --set tokenizer.kind=char --set model.max_seq_length=64" + " --set 'data.train_files=[\"" +
      (dir / "train.csv").string() + "\"]'" + " --set 'data.eval_files=[\"" +
      (dir / "eval.csv").string() + "\"]'" +
      " --set training.micro_batch_size=8 --set training.lr=1e-2 --set training.eval_steps=0" +
      " --set logging.tensorboard_dir= --set parallel.backend=gloo";
  const auto lora = (dir / "lora").string();
  auto lora_run = run_shell("cd " + kSrc + " && " + kBin + "dnallm-launch --nproc-per-node 2" +
                            finetune + " --set training.max_steps=30 --set checkpoint.dir=" + lora +
                            " --metrics-file " + lora + "/metrics.jsonl");
  ASSERT_EQ(lora_run.code, 0) << lora_run.out;
  EXPECT_NE(lora_run.out.find("from the Hugging Face BertForMaskedLM"), std::string::npos)
      << lora_run.out;
  auto scored = run_shell(kBin + "dnallm-eval --model " + lora + "/final --table " +
                          (dir / "eval.csv").string() + " 2>/dev/null");
  ASSERT_EQ(scored.code, 0) << scored.out;
  EXPECT_EQ(nlohmann::json::parse(scored.out).at("rows").get<int64_t>(), 64);
  // The fine-tuned classifier in DNABERT-2's layout (adapters merged), equal to final/.
  nlohmann::json cls = nlohmann::json::parse(std::ifstream(lora + "/final/hf/config.json"));
  EXPECT_EQ(cls.at("architectures").at(0), "BertForSequenceClassification");
  EXPECT_TRUE(cls.contains("auto_map"));
  const auto cls_seqs = (dir / "cls.txt").string();  // within model.max_seq_length = 64
  std::ofstream(cls_seqs) << genome.substr(5000, 60) << "\n" << genome.substr(9000, 45) << "\n";
  const auto c_own = (dir / "c_own.safetensors").string();
  const auto c_hf = (dir / "c_hf.safetensors").string();
  ASSERT_EQ(eval_logits(lora + "/final", cls_seqs, c_own).code, 0);
  ASSERT_EQ(eval_logits(lora + "/final/hf", cls_seqs, c_hf).code, 0);
  const auto ca = floats(c_own, "logits"), cb = floats(c_hf, "logits");
  ASSERT_EQ(ca.size(), 4u);
  ASSERT_EQ(cb.size(), ca.size());
  for (size_t i = 0; i < ca.size(); ++i) EXPECT_NEAR(ca[i], cb[i], 1e-4) << i;
  // dnallm-infer on the fine-tuned model.
  std::ofstream(dir / "in.fa") << ">a\n"
                               << genome.substr(3000, 60) << "\n>b\n"
                               << genome.substr(4000, 50) << "\n";
  auto embed = run_shell(kBin + "dnallm-infer embed --model " + lora + "/final --input " +
                         (dir / "in.fa").string() + " --out " + (dir / "emb.npy").string());
  EXPECT_EQ(embed.code, 0) << embed.out;
  EXPECT_TRUE(fs::exists(dir / "emb.npy"));
  auto predict = run_shell(kBin + "dnallm-infer predict --model " + lora + "/final --input " +
                           (dir / "in.fa").string() + " --out -");
  EXPECT_EQ(predict.code, 0) << predict.out;
  EXPECT_NE(predict.out.find("a,"), std::string::npos) << predict.out;

  // Full fine-tuning (no LoRA), one process.
  const auto full = (dir / "full").string();
  auto full_run =
      run_shell("cd " + kSrc + " && " + kBin + "dnallm-train" + finetune +
                " --set lora.r=0 --set training.max_steps=6 --set checkpoint.dir=" + full +
                " --metrics-file " + full + "/metrics.jsonl");
  ASSERT_EQ(full_run.code, 0) << full_run.out;
  EXPECT_GE(steps_with_finite_loss(full + "/metrics.jsonl"), 1);
  fs::remove_all(dir);
}

// ESM, rotary (Nucleotide Transformer v2's shape without its SwiGLU).
TEST(HfFineTune, EsmContinuedPretrainingWithTheNtSplit) {
  continued_pretraining_with_the_nt_split("esm_mlm");
}

// Nucleotide Transformer v2 / AgroNT: the remote code's SwiGLU without biases, untied head;
// the export carries its auto_map and add_bias_fnn.
TEST(HfFineTune, NucleotideTransformerV2ContinuedPretraining) {
  continued_pretraining_with_the_nt_split("esm_v2_mlm");
}

// Nucleotide Transformer v1: learned positions numbered from its pad id 1 (Note [Positions after
// another pad id]); fine-tuned with our [PAD] = 0 and exported as esm numbering from 0 + 1.
TEST(HfFineTune, NucleotideTransformerV1ContinuedPretraining) {
  continued_pretraining_with_the_nt_split("esm_v1_mlm");
}

}  // namespace

namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The JSON lines of a metrics file whose "event" is `event`.
std::vector<nlohmann::json> events(const std::string& path, const std::string& event) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.value("event", std::string()) == event) out.push_back(j);
  }
  return out;
}

}  // namespace

// scripts/gue-finetune.sh: a GUE-layout task (train/dev/test.csv) fine-tuned once per seed
// with configs/gue-finetune.toml under dnallm-launch (2 workers); each seed's <dir>/best is
// the evaluation with the lowest dev loss (Note [Best checkpoint]), not the last one, whose
// own dev loss dnallm-eval reproduces, and the summary is the mean and sample deviation of the
// seeds' test scores as dnallm-eval prints them.
TEST(HfFineTune, GueProtocolKeepsTheBestDevCheckpointAndAveragesSeeds) {
  const auto dir = fs::path(dnallm::testing::make_temp_dir("gue"));
  const auto task = dir / "task";
  fs::create_directories(task);
  const std::string genome = dnallm::testing::bundled_genome(200000);
  dnallm::testing::write_composition_table((task / "train.csv").string(), genome, 0, 96);
  // The dev set's labels flipped: the better the model learns the task, the worse its dev
  // loss, so the best dev checkpoint is an early one, never simply the last.
  dnallm::testing::write_composition_table((dir / "dev.csv").string(), genome, 60000, 32);
  {
    std::ifstream in(dir / "dev.csv");
    std::ofstream flipped(task / "dev.csv");
    std::string line;
    while (std::getline(in, line)) {
      if (line.size() > 2 && line.compare(line.size() - 2, 2, ",0") == 0)
        line.back() = '1';
      else if (line.size() > 2 && line.compare(line.size() - 2, 2, ",1") == 0)
        line.back() = '0';
      flipped << line << "\n";
    }
  }
  dnallm::testing::write_composition_table((task / "test.csv").string(), genome, 120000, 40);
  const auto out = dir / "out";
  auto r =
      run_shell("cd " + kSrc + " && DNALLM_BUILD_DIR=" + kBin + "/.. scripts/gue-finetune.sh" +
                " --model tests/data/hf-fixtures/bert_cls --task " + task.string() +
                " --seeds '3 4' --nproc 2 --out " + out.string() +
                " --set tokenizer.kind=kmer --set tokenizer.k=3 --set model.max_seq_length=64" +
                " --set training.max_steps=24 --set training.eval_steps=4 --set training.lr=3e-3" +
                " --set training.warmup_steps=0 --set parallel.backend=gloo");
  ASSERT_EQ(r.code, 0) << r.out;

  std::vector<double> mcc;
  std::vector<double> best_values;
  for (const char* seed : {"3", "4"}) {
    const auto run_dir = out / (std::string("seed") + seed);
    const auto best = read_json((run_dir / "checkpoints/best/best.json").string());
    // The kept step is the evaluation with the lowest dev loss (the first of equals).
    const auto evals = events((run_dir / "metrics.jsonl").string(), "eval");
    ASSERT_EQ(evals.size(), 6u) << seed;  // steps 4, 8, ..., 24
    const auto lowest =
        std::min_element(evals.begin(), evals.end(), [](const auto& a, const auto& b) {
          return a.at("loss").template get<double>() < b.at("loss").template get<double>();
        });
    ASSERT_NE(lowest, evals.end() - 1)
        << "the last evaluation was the best: the test proves nothing";
    EXPECT_EQ(best.at("metric"), "loss");
    EXPECT_EQ(best.at("step"), lowest->at("step")) << seed;
    EXPECT_NEAR(best.at("value").get<double>(), lowest->at("loss").get<double>(), 1e-12);
    EXPECT_TRUE(lowest->contains("mcc") && lowest->contains("f1")) << lowest->dump();
    // The kept model is that model: its dev loss, scored again by dnallm-eval.
    auto dev = run_shell(kBin + "dnallm-eval --model " + (run_dir / "checkpoints/best").string() +
                         " --table " + (task / "dev.csv").string() + " 2>/dev/null");
    ASSERT_EQ(dev.code, 0) << dev.out;
    EXPECT_NEAR(nlohmann::json::parse(dev.out).at("loss").get<double>(),
                best.at("value").get<double>(), 1e-4);
    EXPECT_FALSE(fs::exists(run_dir / "checkpoints/best.tmp"));
    const auto test = read_json((run_dir / "test.json").string());
    EXPECT_EQ(test.at("rows"), 40);
    mcc.push_back(test.at("mcc").get<double>());
    best_values.push_back(best.at("value").get<double>());
  }
  EXPECT_NE(best_values[0], best_values[1]) << "the seed changed nothing";
  const auto summary = read_json((out / "summary.json").string());
  EXPECT_EQ(summary.at("runs"), 2);
  const double mean = (mcc[0] + mcc[1]) / 2;
  EXPECT_NEAR(summary.at("mcc").at("mean").get<double>(), mean, 1e-6);
  EXPECT_NEAR(summary.at("mcc").at("std").get<double>(), std::abs(mcc[0] - mcc[1]) / std::sqrt(2.0),
              1e-6);
  for (const char* k : {"f1", "accuracy", "precision", "recall"}) EXPECT_TRUE(summary.contains(k));

  // A task directory without dev.csv: exit 2 before any run.
  fs::remove(task / "dev.csv");
  auto bad = run_shell("cd " + kSrc +
                       " && scripts/gue-finetune.sh --model tests/data/hf-fixtures/bert_cls" +
                       " --task " + task.string());
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("dev.csv not found"), std::string::npos) << bad.out;
}
