// dnallm-config-codegen (Note [Config key files], core/config/schema.hpp): what it writes for a
// key file, and the key files it refuses, each with the file, the key and what is wrong.
#include <fstream>
#include <string>

#include <gtest/gtest.h>

#include "tests/support/process.hpp"

namespace dnallm::testing {
namespace {

// The file `keys` (a section of struct S) run through the generator; its output, or its message.
CommandResult generate(const std::string& keys, std::string* code = nullptr) {
  const std::string dir = make_test_case_dir("config_codegen");
  std::ofstream(dir + "/s.toml") << "section = \"s\"\nstruct = \"S\"\n" << keys;
  CommandResult r =
      run_shell(std::string(DNALLM_CONFIG_CODEGEN) + " " + dir + "/keys.cpp " + dir + "/s.toml");
  if (code) *code = read_text(dir + "/keys.cpp");
  return r;
}

TEST(ConfigCodegen, DeclaresEachKindOfKey) {
  std::string code;
  CommandResult r = generate(
      "[[key]]\nname = \"steps\"\nmin = 0\nmax = 1_048_576\ndoc = \"how many `steps`\"\n"
      "[[key]]\nname = \"lr\"\nmin = 1e-12\ndoc = \"\"\"\nthe \"peak\" \\\n rate\"\"\"\n"
      "[[key]]\nname = \"mode\"\nfield = \"mode_kind\"\nkind = \"choice\"\ndoc = \"a mode\"\n"
      "[[key]]\nname = \"resume\"\nkind = \"resume\"\ndoc = \"where from\"\n"
      "[[key]]\nname = \"flag\"\ndoc = \"on or off\"\n",
      &code);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(code.find("SectionKeys<S>(out, \"s\", &Config::s)\n"
                      "      .range(\"steps\", &S::steps, 0, 1048576, \"how many `steps`\")\n"
                      "      .range(\"lr\", &S::lr, 1e-12, kInf, \"the \\\"peak\\\" rate\")\n"
                      "      .choice(\"mode\", &S::mode_kind, \"a mode\")\n"
                      "      .resume(\"resume\", &S::resume, \"where from\")\n"
                      "      .key(\"flag\", &S::flag, \"on or off\");\n"),
            std::string::npos)
      << code;
}

struct Refusal {
  const char* keys;
  const char* message;
};

TEST(ConfigCodegen, RefusesAKeyFileNamingTheKey) {
  const Refusal cases[] = {
      {"[[key]]\nname = \"a\"\ndoc = \"x\"\nmn = 1\n", "[[key]] 1: unknown field `mn`"},
      {"[[key]]\nname = \"a\"\n", "key `a`: `doc` is missing"},
      {"[[key]]\nname = \"a\"\ndoc = \"x\"\nmin = 5\nmax = 1\n", "key `a`: min 5 is above max 1"},
      {"[[key]]\nname = \"a\"\ndoc = \"x\"\nkind = \"enum\"\n", "key `a`: kind `enum` is not"},
      {"[[key]]\nname = \"a\"\ndoc = \"x\"\nkind = \"choice\"\nmax = 3\n",
       "key `a`: a choice has no min or max"},
      {"[[key]]\nname = \"a\"\ndoc = \"x\"\n[[key]]\nname = \"a\"\ndoc = \"y\"\n",
       "[[key]] 2: `a` is declared twice"},
      {"[[key]]\nname = \"a b\"\ndoc = \"x\"\n", "`name` must be a C++ identifier"},
      {"[[key]\n", "s.toml:3: "},
  };
  for (const Refusal& c : cases) {
    CommandResult r = generate(c.keys);
    EXPECT_EQ(r.code, 2) << c.keys;
    EXPECT_NE(r.out.find(c.message), std::string::npos) << c.keys << "\nsaid: " << r.out;
    EXPECT_NE(r.out.find("s.toml"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace dnallm::testing
