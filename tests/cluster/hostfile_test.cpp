#include "cluster/hostfile.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"
#include "tests/support/expect_error.hpp"

namespace dnallm::cluster {
namespace {

using dnallm::testing::expect_error;

TEST(Hostfile, ParsesSlotsCommentsAndBlanks) {
  const std::string text =
      "# cluster A\n"
      "\n"
      "node01 slots=4\n"
      "node02   slots=2 max_slots=8   # big one\n"
      "node03\n"
      "   \t\n"
      "node04:3\n";
  auto hosts = parse_hostfile(text, "hosts.txt");
  ASSERT_EQ(hosts.size(), 4u);
  EXPECT_EQ(hosts[0].host, "node01");
  EXPECT_EQ(hosts[0].slots, 4);
  EXPECT_EQ(hosts[1].host, "node02");
  EXPECT_EQ(hosts[1].slots, 2);
  EXPECT_EQ(hosts[1].max_slots, 8);
  EXPECT_EQ(hosts[2].host, "node03");
  EXPECT_EQ(hosts[2].slots, 1);
  EXPECT_EQ(hosts[3].host, "node04");
  EXPECT_EQ(hosts[3].slots, 3);
}

TEST(Hostfile, EmptyFileHasNoHosts) {
  EXPECT_TRUE(parse_hostfile("", "h").empty());
  EXPECT_TRUE(parse_hostfile("# only a comment\n\n", "h").empty());
}

TEST(Hostfile, RefusesMalformedLinesWithFileAndLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a slots=4\nb slots=x\n", "hosts.txt:2:"},
      {"a slots=0\n", "hosts.txt:1:"},
      {"a slots=-2\n", "hosts.txt:1:"},
      {"\n\na gpus=2\n", "hosts.txt:3:"},
      {"a 4\n", "hosts.txt:1:"},
      {"a\nb\na\n", "hosts.txt:3:"},
      {"slots=4\n", "hosts.txt:1:"},
      {"a:zz\n", "hosts.txt:1:"},
      {"a slots=4 max_slots=2\n", "hosts.txt:1:"},
  };
  for (const auto& [text, where] : cases) {
    try {
      parse_hostfile(text, "hosts.txt");
      ADD_FAILURE() << "accepted: " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_EQ(std::string(e.what()).rfind(where, 0), 0u) << text << " -> " << e.what();
    }
  }
}

TEST(Hostfile, MissingFileIsUsageError) {
  expect_error([&] { load_hostfile("/nonexistent/dnallm-hosts"); }, ExitCode::kUsage,
               {"/nonexistent/dnallm-hosts"});
}

}  // namespace
}  // namespace dnallm::cluster
