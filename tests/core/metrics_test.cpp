// The metrics writer: the JSON Lines file and the TensorBoard events come from the same event
// objects (every number of every line is a scalar of the matching event, at its step), a
// resumed run appends, and an unwritable path is a usage error.
#include "core/metrics.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"
#include "tests/support/process.hpp"

namespace dnallm {
namespace {

using dnallm::testing::expect_error;
using dnallm::testing::make_temp_dir;

namespace fs = std::filesystem;
using nlohmann::ordered_json;

std::vector<ordered_json> read_lines(const fs::path& path) {
  std::ifstream in(path);
  std::vector<ordered_json> out;
  for (std::string line; std::getline(in, line);) out.push_back(ordered_json::parse(line));
  return out;
}

std::vector<ordered_json> sample_events() {
  return {
      {{"step", 1}, {"loss", 2.5}, {"lr", 1e-4}, {"skipped", true}},
      {{"event", "eval"}, {"step", 1}, {"loss", 2.25}, {"bits_per_base", 1.75}},
      {{"event", "memory"}, {"rank", 0}, {"zero_paper_bytes", {{"params", 8}}}},
      {{"event", "restart"}, {"generation", 2}, {"reason", "rank 1 exited with code 9"}},
      {{"event", "summary"}, {"steps", 1}, {"final_loss", 2.5}},
  };
}

TEST(MetricsTest, JsonLinesAndTensorBoardHoldTheSameNumbers) {
  const auto dir = fs::path(make_temp_dir("metrics_same"));
  const auto events = sample_events();
  std::string tb_path;
  {
    MetricsWriter w({(dir / "sub" / "m.jsonl").string(), false, (dir / "tb").string()});
    tb_path = w.tensorboard_path();
    for (const auto& e : events) w.write(e);
  }
  const auto lines = read_lines(dir / "sub" / "m.jsonl");
  ASSERT_EQ(lines.size(), events.size());
  for (size_t i = 0; i < events.size(); ++i) EXPECT_EQ(lines[i], events[i]) << i;

  const auto records = read_event_file(tb_path);
  ASSERT_EQ(records.size(), 1 + events.size());  // the file_version record first
  int64_t step = 0;
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& r = records[i + 1];
    if (events[i].contains("step")) step = events[i]["step"].get<int64_t>();
    EXPECT_EQ(r.step, step) << i;  // events without a step keep the last one
    const auto want = tensorboard_scalars(events[i]);
    ASSERT_EQ(r.scalars.size(), want.size()) << i;
    for (size_t k = 0; k < want.size(); ++k) {
      EXPECT_EQ(r.scalars[k].first, want[k].first);
      EXPECT_FLOAT_EQ(r.scalars[k].second, static_cast<float>(want[k].second));
    }
  }
  fs::remove_all(dir);
}

TEST(MetricsTest, ScalarTagsNameTheEventAndSkipStepAndNonNumbers) {
  const auto s = tensorboard_scalars(sample_events()[0]);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].first, "train/loss");
  EXPECT_EQ(s[1].first, "train/lr");
  const auto restart = tensorboard_scalars(sample_events()[3]);
  ASSERT_EQ(restart.size(), 1u);
  EXPECT_EQ(restart[0].first, "restart/generation");
  EXPECT_TRUE(tensorboard_scalars(sample_events()[2]).size() == 1u);  // rank; not the object
}

TEST(MetricsTest, AppendKeepsEarlierRunsAndTruncateDoesNot) {
  const auto dir = fs::path(make_temp_dir("metrics_append"));
  const auto path = (dir / "m.jsonl").string();
  MetricsWriter({path, false, ""}).write({{"step", 1}});
  MetricsWriter({path, true, ""}).write({{"step", 2}});
  EXPECT_EQ(read_lines(path).size(), 2u);
  MetricsWriter({path, false, ""}).write({{"step", 3}});
  ASSERT_EQ(read_lines(path).size(), 1u);
  EXPECT_EQ(read_lines(path)[0]["step"], 3);
  fs::remove_all(dir);
}

TEST(MetricsTest, AnUnwritablePathIsAUsageError) {
  const auto dir = fs::path(make_temp_dir("metrics_bad"));
  fs::create_directories(dir / "a_directory");
  expect_error(
      [&] {
        MetricsWriter w({(dir / "a_directory").string(), false, ""});
      },
      ExitCode::kUsage, {"logging.metrics_file"});
  fs::remove_all(dir);
}

TEST(MetricsTest, NothingConfiguredWritesNothing) {
  MetricsWriter w({"", false, ""});
  w.write({{"step", 1}});
  EXPECT_EQ(w.tensorboard_path(), "");
}

}  // namespace
}  // namespace dnallm
