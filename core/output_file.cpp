// See output_file.hpp.
#include "core/output_file.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <iostream>
#include <thread>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dnallm {

// Note [Outputs never inputs]: every file a program writes where its user says (dnallm-infer's
// --out and the embedding files beside it, dnallm-eval --logits --out) is checked before any
// work: not an existing directory, not any file the command reads (the same file by device and
// inode, or the same resolved path: a hard link or a symlink counts), in an existing directory.
// An input's index (.fai, .gzi, .tbi, .csi beside it, which htslib reads) counts as an input.
// It is then written as a temporary file in its own directory and renamed over the final name
// only when complete (OutputFile; the embedding writer and the safetensors writer do the same),
// so a failed run never leaves a truncated output or a destroyed input. An output that exists
// and is not a regular file (a device such as /dev/null, a FIFO, /dev/stdout) is never renamed
// over: a rename would replace the device node itself (as root, /dev/null for everyone; issue
// 57). A text output (OutputFile) is written in place there, and a failed write (/dev/full) is
// exit 2; an output whose header is written after its data (.npy, .safetensors) can only be a
// regular file, so such a name is exit 2 before any work (require_regular_output).
void check_output(const std::string& out, const std::vector<std::string>& inputs,
                  std::string_view flag) {
  namespace fs = std::filesystem;
  if (out == "-") return;
  std::vector<std::string> reads = inputs;
  for (const auto& in : inputs) {
    for (const char* index : {".fai", ".gzi", ".tbi", ".csi"}) reads.push_back(in + index);
  }
  struct stat o {};
  if (::stat(out.c_str(), &o) == 0) {
    DNALLM_CHECK(!S_ISDIR(o.st_mode), ExitCode::kUsage,
                 "{} {} is an existing directory: name a file (e.g. {}/out{})", flag, out, out,
                 fs::path(out).extension().string());
    for (const auto& in : reads) {
      struct stat i {};
      if (::stat(in.c_str(), &i) != 0) continue;
      DNALLM_CHECK(!(i.st_dev == o.st_dev && i.st_ino == o.st_ino), ExitCode::kUsage,
                   "{} {} is the same file as {}, which this command reads: writing it would "
                   "destroy the input; name another output file",
                   flag, out, in);
    }
  }
  std::error_code ec;
  const auto resolved = fs::weakly_canonical(out, ec);
  for (const auto& in : reads) {
    std::error_code ec_in;
    const auto r = fs::weakly_canonical(in, ec_in);
    DNALLM_CHECK(ec || ec_in || r != resolved, ExitCode::kUsage,
                 "{} {} is the same file as {}, which this command reads: writing it would "
                 "destroy the input; name another output file",
                 flag, out, in);
  }
  const auto parent = fs::path(out).has_parent_path() ? fs::path(out).parent_path() : ".";
  DNALLM_CHECK(fs::is_directory(parent, ec), ExitCode::kUsage,
               "{} {}: the directory {} does not exist; create it first", flag, out,
               parent.string());
}

bool written_in_place(const std::string& out) {
  struct stat o {};
  return ::stat(out.c_str(), &o) == 0 && !S_ISREG(o.st_mode) && !S_ISDIR(o.st_mode);
}

void require_regular_output(const std::string& out, std::string_view flag, std::string_view why) {
  struct stat o {};
  if (::stat(out.c_str(), &o) != 0 || S_ISREG(o.st_mode) || S_ISDIR(o.st_mode)) return;
  fail(ExitCode::kUsage,
       "{} {} is not a regular file (a {}): {}, which only a regular file takes; name a "
       "regular file",
       flag, out,
       S_ISFIFO(o.st_mode)   ? "FIFO"
       : S_ISSOCK(o.st_mode) ? "socket"
                             : "device",
       why);
}

OutputFile::OutputFile(std::string out) : out_(std::move(out)) {
  if (out_ == "-") return;
  if (written_in_place(out_)) {  // Note [Outputs never inputs]: a device or a FIFO
    file_.open(out_);
    DNALLM_CHECK(file_.good(), ExitCode::kUsage, "cannot write --out {}: {}", out_, errno_string());
    return;
  }
  tmp_ = fmt::format("{}.tmp.{}", out_, ::getpid());
  file_.open(tmp_);
  DNALLM_CHECK(file_.good(), ExitCode::kUsage, "cannot write --out {} ({}): {}", out_, tmp_,
               errno_string());
}

OutputFile::~OutputFile() {
  if (tmp_.empty() || committed_) return;
  file_.close();
  std::error_code ec;
  std::filesystem::remove(tmp_, ec);
}

std::ostream& OutputFile::stream() { return out_ == "-" ? std::cout : file_; }

void OutputFile::commit() {
  stream().flush();
  DNALLM_CHECK(stream().good(), ExitCode::kUsage, "write to --out {} failed: {}", out_,
               errno_string());
  if (out_ == "-") return;
  file_.close();
  DNALLM_CHECK(!file_.fail(), ExitCode::kUsage, "write to --out {} failed: {}", out_,
               errno_string());
  if (!tmp_.empty()) {  // written in place (a device or a FIFO) when empty
    std::error_code ec;
    std::filesystem::rename(tmp_, out_, ec);
    DNALLM_CHECK(!ec, ExitCode::kUsage, "cannot rename {} to --out {}: {}", tmp_, out_,
                 ec.message());
  }
  committed_ = true;
}

std::string unique_temp_suffix() {
  return std::to_string(::getpid()) + "." +
         std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
}

}  // namespace dnallm
