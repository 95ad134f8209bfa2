// dnallm-ckpt export of a trainer checkpoint writes the model under its parameter names (the
// layout recorded in the manifest), identical to the trainer's own final export, with a
// config.json that dnallm-eval loads.
#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "../ddp/test_util.hpp"

namespace dnallm::testing {
namespace {

TEST(CheckpointExport, StepCheckpointExportsLikeTheFinalModel) {
  const std::string dir = make_temp_dir("ckpt_export");
  std::string log;
  // 2 ranks with ZeRO-1: each shard holds half of the flat buffer.
  ASSERT_EQ(
      run_command(
          fmt::format("cd {src} && {bin}dnallm-launch --nproc-per-node 2 -- {bin}dnallm-train "
                      "--set model.hidden=32 --set model.layers=2 --set model.heads=2 "
                      "--set model.ffn=64 --set model.max_seq_length=64 "
                      "--set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
                      "--set training.max_steps=3 --set training.micro_batch_size=4 "
                      "--set parallel.backend=gloo --set parallel.zero_stage=1 "
                      "--set checkpoint.save_steps=3 --set checkpoint.dir={dir}/ck "
                      "--set checkpoint.resume=none",
                      fmt::arg("src", kSrc), fmt::arg("bin", kBin), fmt::arg("dir", dir)),
          &log),
      0)
      << log;
  ASSERT_EQ(run_command(fmt::format("{}dnallm-ckpt export {}/ck --out {}/exported", kBin, dir, dir),
                        &log),
            0)
      << log;
  auto exported = read_safetensors_f32(dir + "/exported/model.safetensors");
  auto final_model = read_safetensors_f32(dir + "/ck/final/model.safetensors");
  EXPECT_EQ(exported.count("flat.params"), 0u) << "raw flat buffer exported";
  ASSERT_EQ(exported.size(), final_model.size());
  for (const auto& [name, values] : final_model) {
    ASSERT_TRUE(exported.count(name)) << name;
    EXPECT_EQ(exported.at(name), values) << name;
  }
  ASSERT_TRUE(std::filesystem::exists(dir + "/exported/config.json"));
  ASSERT_TRUE(std::filesystem::exists(dir + "/exported/tokenizer.json"));
  std::string eval_exported, eval_final;
  ASSERT_EQ(run_command(fmt::format("cd {} && {}dnallm-eval --model {}/exported --fasta "
                                    "data/ecoli_k12_mg1655.fa.gz --max-bases 4000 2>/dev/null",
                                    kSrc, kBin, dir),
                        &eval_exported),
            0)
      << eval_exported;
  ASSERT_EQ(run_command(fmt::format("cd {} && {}dnallm-eval --model {}/ck/final --fasta "
                                    "data/ecoli_k12_mg1655.fa.gz --max-bases 4000 2>/dev/null",
                                    kSrc, kBin, dir),
                        &eval_final),
            0);
  auto loss_of = [](const std::string& out) { return out.substr(out.find("\"loss\"")); };
  EXPECT_EQ(loss_of(eval_exported), loss_of(eval_final));
}

}  // namespace
}  // namespace dnallm::testing
