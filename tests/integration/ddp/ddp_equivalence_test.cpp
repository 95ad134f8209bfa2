// N ranks with DDP / ZeRO-1 / ZeRO-2 (each accumulation policy) train the same model as one
// rank with the same global batch: same per-step losses and final parameters, within fp32
// summation-order tolerance. Real processes: dnallm-launch spawns dnallm-train workers that
// reduce gradients over Gloo on loopback.
#include <cmath>
#include <filesystem>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "test_util.hpp"

namespace dnallm::testing {
namespace {

const std::string kBin = std::string(DNALLM_BINARY_DIR) + "/bin/";

struct TrainRun {
  std::map<int64_t, double> losses;
  std::map<std::string, std::vector<float>> params;
};

// Global batch 12 sequences of 64 tokens, 5 steps, tiny BERT, fp32, no dropout.
// `starter` runs `world` workers; by default dnallm-launch.
TrainRun train(const std::string& name, int world, int micro, int accum, const std::string& extra,
               std::string starter = "") {
  std::string dir = make_temp_dir(name);
  if (starter.empty()) starter = fmt::format("{}dnallm-launch --nproc-per-node {} --", kBin, world);
  std::string cmd = tiny_train_command(
      starter, dir, micro, accum,
      (extra.find("parallel.backend") == std::string::npos ? "--set parallel.backend=gloo "
                                                           : "") +
          extra);
  std::string log;
  int rc = run_command(cmd, &log);
  EXPECT_EQ(rc, 0) << cmd << "\n" << log;
  TrainRun r;
  if (rc != 0) return r;
  r.losses = read_step_losses(dir + "/metrics.jsonl");
  r.params = read_safetensors_f32(dir + "/ckpt/final/model.safetensors");
  return r;
}

void expect_equivalent(const TrainRun& one, const TrainRun& many, const std::string& what) {
  ASSERT_EQ(one.losses.size(), 5u) << what;
  ASSERT_EQ(many.losses.size(), 5u) << what;
  for (const auto& [step, loss] : one.losses) {
    EXPECT_NEAR(many.losses.at(step), loss, 2e-5 * std::abs(loss)) << what << " step " << step;
  }
  ASSERT_EQ(one.params.size(), many.params.size()) << what;
  double max_diff = 0;
  for (const auto& [name, v] : one.params) {
    const auto& w = many.params.at(name);
    ASSERT_EQ(v.size(), w.size()) << name;
    for (size_t i = 0; i < v.size(); ++i) max_diff = std::max(max_diff, double(std::abs(v[i] - w[i])));
  }
  // 5 Adam steps of lr 3e-3 move parameters by up to ~1.5e-2; summation order differences
  // stay orders of magnitude below that.
  EXPECT_LT(max_diff, 2e-4) << what << ": largest parameter difference " << max_diff;
}

class DdpEquivalence : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { reference_ = new TrainRun(train("ref", 1, 12, 1, "")); }
  static void TearDownTestSuite() { delete reference_; }
  static TrainRun* reference_;
};
TrainRun* DdpEquivalence::reference_ = nullptr;

TEST_F(DdpEquivalence, AccumulationOnOneRankEqualsOneBigBatch) {
  expect_equivalent(*reference_, train("accum1", 1, 4, 3, ""), "1 rank, 3 micro-steps of 4");
}

TEST_F(DdpEquivalence, DdpTwoRanksSyncLast) {
  expect_equivalent(*reference_, train("ddp2", 2, 3, 2, "--set parallel.accumulate_sync=last"),
                    "DDP 2 ranks, last");
}

TEST_F(DdpEquivalence, DdpThreeRanksSyncEvery) {
  expect_equivalent(*reference_, train("ddp3", 3, 2, 2, "--set parallel.accumulate_sync=every"),
                    "DDP 3 ranks, every");
}

TEST_F(DdpEquivalence, Zero1ThreeRanks) {
  expect_equivalent(*reference_, train("z1", 3, 4, 1, "--set parallel.zero_stage=1"),
                    "ZeRO-1 3 ranks");
}

TEST_F(DdpEquivalence, Zero2TwoRanks) {
  expect_equivalent(*reference_,
                    train("z2", 2, 3, 2, "--set parallel.zero_stage=2"), "ZeRO-2 2 ranks");
}

TEST_F(DdpEquivalence, Zero1TwoRanksSyncEvery) {
  expect_equivalent(*reference_,
                    train("z1e", 2, 2, 3,
                          "--set parallel.zero_stage=1 --set parallel.accumulate_sync=every"),
                    "ZeRO-1 2 ranks, every");
}

// Note [Staged collectives] on CPU: every collective copied through the staging thread's
// host buffers (as a CUDA model's buckets are through pinned memory) trains like 1 rank.
TEST_F(DdpEquivalence, StagedCollectivesTwoRanks) {
  const std::string staged =
      fmt::format("DNALLM_TEST_STAGE_HOST_BUFFERS=1 {}dnallm-launch --nproc-per-node 2 --", kBin);
  expect_equivalent(*reference_, train("staged2", 2, 3, 2, "", staged), "staged DDP 2 ranks");
  expect_equivalent(*reference_, train("staged_z2", 2, 3, 2, "--set parallel.zero_stage=2", staged),
                    "staged ZeRO-2 2 ranks");
}

TEST_F(DdpEquivalence, MpirunThreeRanksWithoutLauncher) {
  // A static MPI world: no launcher, no store; "auto" picks the mpi backend under mpirun.
  expect_equivalent(*reference_,
                    train("mpi3", 3, 4, 1, "--set parallel.backend=auto",
                          "mpirun --allow-run-as-root --oversubscribe -np 3"),
                    "mpirun -np 3");
}

TEST_F(DdpEquivalence, MpirunTwoLaunchersAsTwoNodes) {
  // `mpirun --map-by ppr:1:node dnallm-launch` on one machine: each MPI rank is a "node"
  // (Note [mpirun placement]); node rank from OMPI_COMM_WORLD_RANK, the port from the mpirun
  // job id, 127.0.0.1 as every rank is here; the token is shared through -x. Two nodes of
  // one worker each must train like one rank with the same global batch (if each launcher
  // ran alone, its batch of 6 would give other losses).
  expect_equivalent(
      *reference_,
      train("mpi_launch2", 2, 6, 1, "",
            fmt::format("DNALLM_JOB_TOKEN=mpirun-test-token OMP_NUM_THREADS=1 mpirun "
                        "--allow-run-as-root --oversubscribe -np 2 -x DNALLM_JOB_TOKEN "
                        "-x OMP_NUM_THREADS {}dnallm-launch --nproc-per-node 1 --",
                        kBin)),
      "mpirun -np 2 dnallm-launch --nproc-per-node 1");
}

TEST_F(DdpEquivalence, Bf16GradientReductionStaysClose) {
  // Compression changes the numbers (bf16 has 8 bits of mantissa): close, not equal.
  TrainRun r = train("bf16red", 2, 6, 1, "--set parallel.grad_reduce_dtype=bf16");
  ASSERT_EQ(r.losses.size(), 5u);
  for (const auto& [step, loss] : reference_->losses) {
    EXPECT_NEAR(r.losses.at(step), loss, 2e-2 * std::abs(loss)) << "step " << step;
  }
}

}  // namespace
}  // namespace dnallm::testing
