// Note [One GPU per rank]: device index, rank/GPU count checks, GPU counting.
#include "cluster/gpu_placement.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::cluster {
namespace {

using dnallm::testing::expect_error;

TEST(VisibleGpuCount, CudaVisibleDevicesWinsOverTheHostCount) {
  EXPECT_EQ(visible_gpu_count({}, 4), 4);
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", "0,1,3"}}, 8), 3);
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", "2"}}, 8), 1);
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", "GPU-1a2b,GPU-3c4d"}}, 8), 2);
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", "MIG-5e6f"}}, 1), 1);
  // Hidden: "" and "-1"; CUDA stops at the first invalid entry.
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", ""}}, 8), 0);
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", "-1"}}, 8), 0);
  EXPECT_EQ(visible_gpu_count({{"CUDA_VISIBLE_DEVICES", "0,-1,2"}}, 8), 1);
}

TEST(PlaceOnGpu, OneGpuPerLocalRank) {
  for (int r = 0; r < 4; ++r) {
    auto p = place_on_gpu(r, 4, 4, false);
    EXPECT_EQ(p.device_index, r);
    EXPECT_FALSE(p.shared);
  }
  // Fewer ranks than GPUs: the first GPUs.
  EXPECT_EQ(place_on_gpu(1, 2, 8, false).device_index, 1);
}

TEST(PlaceOnGpu, TooManyRanksNamesBothNumbers) {
  expect_error([&] { place_on_gpu(0, 3, 2, false); }, ExitCode::kUsage,
               {"3 ranks on this node", "only 2 visible GPU(s)", "parallel.share_gpus = true"});
}

TEST(PlaceOnGpu, SharingIsExplicitAndRoundRobin) {
  auto a = place_on_gpu(0, 2, 1, true);
  auto b = place_on_gpu(1, 2, 1, true);
  EXPECT_EQ(a.device_index, 0);
  EXPECT_EQ(b.device_index, 0);
  EXPECT_TRUE(a.shared && b.shared);
  EXPECT_EQ(place_on_gpu(3, 4, 2, true).device_index, 1);
  // share_gpus with enough GPUs shares nothing.
  EXPECT_FALSE(place_on_gpu(1, 2, 2, true).shared);
}

TEST(PlaceOnGpu, OneGpuBoundPerTaskByTheSchedulerIsNotSharing) {
  // srun --gpus-per-task=1: 4 tasks on the node, each sees only its own GPU.
  for (int r = 0; r < 4; ++r) {
    auto p = place_on_gpu(r, 4, 1, false, /*scheduler_binds_gpus=*/true);
    EXPECT_EQ(p.device_index, 0);
    EXPECT_FALSE(p.shared);
  }
  // A launcher's workers all see the same GPUs: one GPU for 4 ranks is sharing.
  EXPECT_THROW(place_on_gpu(1, 4, 1, false, false), Error);
  // Two GPUs visible to 4 scheduled tasks is no per-task binding: still an error.
  EXPECT_THROW(place_on_gpu(1, 4, 2, false, true), Error);
}

TEST(PlaceOnGpu, NoVisibleGpuIsAUsageError) {
  expect_error([&] { place_on_gpu(0, 1, 0, true); }, ExitCode::kUsage, {"CUDA_VISIBLE_DEVICES"});
}

TEST(CountHostGpus, DevNodesThenTheDriversProcFolder) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("gpu_count_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir / "dev");
  fs::create_directories(dir / "proc");
  for (const char* n : {"nvidiactl", "nvidia-uvm", "nvidia-modeset"})
    std::ofstream(dir / "dev" / n);
  fs::create_directories(dir / "proc" / "0000:17:00.0");
  fs::create_directories(dir / "proc" / "0000:65:00.0");
  // No /dev/nvidiaN: the driver's folder counts.
  EXPECT_EQ(count_host_gpus((dir / "dev").string(), (dir / "proc").string()), 2);
  for (const char* n : {"nvidia0", "nvidia1", "nvidia2"}) std::ofstream(dir / "dev" / n);
  EXPECT_EQ(count_host_gpus((dir / "dev").string(), (dir / "proc").string()), 3);
  EXPECT_EQ(count_host_gpus((dir / "missing").string(), (dir / "missing").string()), 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dnallm::cluster
