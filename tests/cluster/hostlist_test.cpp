#include "cluster/hostlist.hpp"

#include <gtest/gtest.h>

#include "core/error.hpp"

namespace dnallm::cluster {
namespace {

using Hosts = std::vector<std::string>;

struct ExpandCase {
  const char* list;
  Hosts hosts;
};

// Every expected value below was checked against Slurm's own `scontrol show hostnames`
// (slurm-wlm 22.05). We accept two things Slurm refuses, "[1-2]x" and "a[1-2]b" (text
// after the last bracket), as the obvious expansion.
TEST(Hostlist, ExpandsTable) {
  const std::vector<ExpandCase> cases = {
      {"a[1-2][3-4]", {"a13", "a14", "a23", "a24"}},
      {"a[1-03]", {"a1", "a2", "a3"}},
      {"a[007-9]", {"a007", "a008", "a009"}},
      {"x[1,1]", {"x1", "x1"}},
      {"n[9-10]", {"n9", "n10"}},
      {"", {}},
      {"  ", {}},
      {"node1", {"node1"}},
      {"host1,host2", {"host1", "host2"}},
      {"gpu[01-04,07]", {"gpu01", "gpu02", "gpu03", "gpu04", "gpu07"}},
      {"host1,host2[5-6]", {"host1", "host25", "host26"}},
      {"a[1-2]-b[3-4]", {"a1-b3", "a1-b4", "a2-b3", "a2-b4"}},
      {"n[8-11]", {"n8", "n9", "n10", "n11"}},
      {"n[08-11]", {"n08", "n09", "n10", "n11"}},
      {"n[098-101]", {"n098", "n099", "n100", "n101"}},
      {"[1-2]x", {"1x", "2x"}},
      {"r[1-2]n[1],z", {"r1n1", "r2n1", "z"}},
      {"c[5]", {"c5"}},
      {"c[3,1]", {"c3", "c1"}},
      {"a,a", {"a", "a"}},
      {"x-1.example.org,x-2.example.org", {"x-1.example.org", "x-2.example.org"}},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(expand_hostlist(c.list), c.hosts) << c.list;
  }
}

struct BadCase {
  const char* list;
  const char* position;  // "at character N" expected in the message
};

TEST(Hostlist, RefusesMalformedWithPosition) {
  const std::vector<BadCase> cases = {
      {"gpu[01-04", "at character 4:"},      // never closed
      {"gpu01]", "at character 6:"},         // stray ]
      {"gpu[a-b]", "at character 5:"},       // not a number
      {"gpu[4-1]", "at character 5:"},       // lo > hi
      {"gpu[1-]", "at character 7:"},        // missing hi
      {"gpu[]", "at character 5:"},          // empty bracket
      {"a,,b", "at character 3:"},           // empty item
      {",a", "at character 1:"},             // empty first item
      {"a,", "at character 2:"},             // trailing comma
      {"g[1[2]]", "at character 4:"},        // nested bracket
      {"a b", "at character 2:"},            // blank inside
      {"n[0-99999999]", "at character 3:"},  // too many
  };
  for (const auto& c : cases) {
    try {
      expand_hostlist(c.list);
      ADD_FAILURE() << "accepted " << c.list;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage) << c.list;
      EXPECT_NE(std::string(e.what()).find(c.position), std::string::npos)
          << c.list << " -> " << e.what();
      EXPECT_NE(std::string(e.what()).find(c.list), std::string::npos) << e.what();
    }
  }
}

TEST(Hostlist, CompressesTable) {
  const std::vector<std::pair<Hosts, std::string>> cases = {
      {{}, ""},
      {{"a"}, "a"},
      {{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07"}, "gpu[01-04,07]"},
      {{"n9", "n10", "n11"}, "n9,n[10-11]"},
      {{"x", "n1", "n2", "y"}, "x,n[1-2],y"},
      {{"a1", "b1"}, "a1,b1"},
      {{"n3", "n2"}, "n[3,2]"},
      {{"a1-b3", "a1-b4"}, "a1-b[3-4]"},
  };
  for (const auto& [hosts, text] : cases) {
    EXPECT_EQ(compress_hostlist(hosts), text);
    EXPECT_EQ(expand_hostlist(compress_hostlist(hosts)), hosts) << text;
  }
}

TEST(Hostlist, RoundTripsExpansions) {
  for (const char* list : {"gpu[01-04,07]", "a[1-2]-b[3-4]", "n[098-101],m[1-3,5,7-9]"}) {
    Hosts hosts = expand_hostlist(list);
    EXPECT_EQ(expand_hostlist(compress_hostlist(hosts)), hosts) << list;
  }
}

}  // namespace
}  // namespace dnallm::cluster
