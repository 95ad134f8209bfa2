// Files a program writes where its user says (`--out`): Note [Outputs never inputs]
// (output_file.cpp). Every program's --out goes through these: dnallm-infer's subcommands, its
// embedding files, dnallm-eval --logits. Torch-free.
#pragma once

#include <fstream>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace dnallm {

// Note [Outputs never inputs]: Error(kUsage) before any work when `out` is an existing
// directory, one of `inputs` or an input's index (.fai, .gzi, .tbi, .csi beside it), or in a
// missing directory. `flag` names the output in messages ("--out", "--out's ids file").
void check_output(const std::string& out, const std::vector<std::string>& inputs,
                  std::string_view flag = "--out");

// Whether `out` exists and is neither a regular file nor a directory (a device such as
// /dev/null, a FIFO, /dev/stdout): such an output is written in place, never replaced by a
// rename.
bool written_in_place(const std::string& out);

// Error(kUsage) when `out` is written_in_place(): for an output that can only be a regular
// file (one whose header is written after its data, by seeking back). `why` says how it is
// written ("the header is written last"), for "..., which only a regular file takes".
void require_regular_output(const std::string& out, std::string_view flag, std::string_view why);

// "<pid>.<thread>": a suffix for temporary names that concurrent ranks and threads never share
// (<path>.tmp.<suffix>, renamed over <path> when whole).
std::string unique_temp_suffix();

// An output file written whole or not at all (Note [Outputs never inputs]): the stream goes to
// <out>.tmp.<pid> in the same directory, renamed to `out` by commit(); "-" is stdout; an `out`
// that is written_in_place() is opened and written as it is. A failed write is Error(kUsage)
// naming `out` and the system's reason. The destructor removes the temporary file of an output
// that was not committed.
class OutputFile {
 public:
  explicit OutputFile(std::string out);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();
  std::ostream& stream();
  void commit();

 private:
  std::string out_, tmp_;
  std::ofstream file_;
  bool committed_ = false;
};

}  // namespace dnallm
