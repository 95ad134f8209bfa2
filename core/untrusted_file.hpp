// Reading files that a user names or that come in a downloaded directory (config files,
// config.json, tokenizer files, vocab.txt, safetensors headers) without trusting them:
// Note [Untrusted files]. Every reader checks that the path is a regular file (symlinks
// followed; a directory, device, FIFO or symlink loop is refused) and reads at most a stated
// number of bytes, so `--config /dev/zero` or a vocab.txt linked to /dev/zero fails at once
// instead of after gigabytes. Error messages quote file content through clip_for_message(),
// so no message carries megabytes of it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace dnallm {

// Size limits of the small files we read whole (documented in docs/hugging-face.md).
inline constexpr uint64_t kMaxConfigFileBytes = uint64_t{16} << 20;     // TOML, config.json
inline constexpr uint64_t kMaxTokenizerFileBytes = uint64_t{64} << 20;  // tokenizer.json, vocab

// Throws Error(code) unless `path` is a regular file (after following symlinks): names what
// it is instead (a directory, a device, a FIFO, a symlink loop, missing). `what` says what
// the file is for ("--config", "model.safetensors"). Returns its size in bytes.
uint64_t check_regular_file(const std::string& path, ExitCode code, std::string_view what);

// The whole of `path` (a regular file, see check_regular_file) when it holds at most
// `max_bytes`; else Error(code) naming the path, its size and the limit.
std::string read_bounded_file(const std::string& path, uint64_t max_bytes, ExitCode code,
                              std::string_view what);

// `text` cut to at most `max_chars` characters (then "... (N bytes in all)"), control
// characters shown as '?': for quoting file content in a one-line message.
std::string clip_for_message(std::string_view text, size_t max_chars = 120);

// JSON text parsed strictly: Error(code) naming `where` on a syntax error or on a key that
// appears twice in one object (nlohmann would silently keep the last).
nlohmann::json parse_json_strict(const std::string& text, const std::string& where, ExitCode code);

}  // namespace dnallm
