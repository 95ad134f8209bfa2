// Shared by every test that runs the project's real binaries: where they are, running a shell
// command line with its output captured, temporary directories and small inputs made from the
// bundled genome. Linked into every dnallm_test() target
// (tests/CMakeLists.txt), which also compiles in DNALLM_SOURCE_DIR and DNALLM_BINARY_DIR.
#pragma once

#include <cstddef>
#include <string>

namespace dnallm::testing {

// The build's bin/ folder (with the trailing '/': kBin + "dnallm-train") and the source tree
// (configs/ and data/ are relative to it).
inline const std::string kBin = std::string(DNALLM_BINARY_DIR) + "/bin/";
inline const std::string kSrc = DNALLM_SOURCE_DIR;

// What a command printed and how it ended.
struct CommandResult {
  int code = -1;    // its exit status; 128 + N when signal N ended it
  std::string out;  // stdout, and with Streams::kBoth stderr too (interleaved)
};

enum class Streams {
  kBoth,        // capture stdout and stderr (2>&1)
  kStdoutOnly,  // capture stdout; stderr is discarded (2>/dev/null), e.g. to parse JSON
};

// Runs `cmd` through /bin/sh and waits for it. Throws std::runtime_error if it cannot start.
CommandResult run_shell(const std::string& cmd, Streams streams = Streams::kBoth);

// run_shell(cmd).code; stdout+stderr go to `log` if given.
int run_command(const std::string& cmd, std::string* log = nullptr);

// The exit code of a wait status (std::system, pclose, waitpid): 128 + N for signal N.
int exit_code_of(int wait_status);

// The whole content of a text file ("" when it cannot be read).
std::string read_text(const std::string& path);

// Whether `text` holds `part`.
bool contains(const std::string& text, const std::string& part);

// A fresh (emptied) directory <gtest TempDir>/dnallm_<name>_<pid>.
std::string make_temp_dir(const std::string& name);
// A fresh (emptied) directory of the running test case:
// <system temp>/dnallm_<name>_<pid>_<test case name>.
std::string make_test_case_dir(const std::string& name);

// The bases of the bundled E. coli genome (data/ecoli_k12_mg1655.fa.gz) in its first `bytes`
// decompressed bytes, as one string (the header line dropped).
std::string bundled_genome(size_t bytes);

// A labelled table (CSV: sequence,label) of `rows` consecutive 60-base windows of `genome`
// from `offset`: even rows are the genome (label 0), odd rows the same with every A turned
// into C (label 1), a composition difference a classifier must pick up.
void write_composition_table(const std::string& path, const std::string& genome, size_t offset,
                             size_t rows);

}  // namespace dnallm::testing
