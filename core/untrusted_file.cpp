#include "core/untrusted_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <set>
#include <vector>

namespace dnallm {

uint64_t check_regular_file(const std::string& path, ExitCode code, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    if (err == ELOOP) {
      fail(code, "{} {} is a symbolic link loop: point it at a regular file", what, path);
    }
    fail(code, "cannot read {} {}: {}", what, path, errno_string(err));
  }
  if (S_ISDIR(st.st_mode)) {
    fail(code, "{} {} is a directory, not a file: name the file itself", what, path);
  }
  if (!S_ISREG(st.st_mode)) {
    fail(code, "{} {} is not a regular file (a {}): give a regular file", what, path,
         S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "device"
         : S_ISFIFO(st.st_mode)                     ? "FIFO"
         : S_ISSOCK(st.st_mode)                     ? "socket"
                                                    : "special file");
  }
  return static_cast<uint64_t>(st.st_size);
}

std::string read_bounded_file(const std::string& path, uint64_t max_bytes, ExitCode code,
                              std::string_view what) {
  const uint64_t size = check_regular_file(path, code, what);
  if (size > max_bytes) {
    fail(code,
         "{} {} holds {} bytes, more than the {} bytes allowed for such a file: is it the right "
         "file?",
         what, path, size, max_bytes);
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(code, "cannot read {} {}: {}", what, path, errno_string());
  std::string text;
  text.resize(static_cast<size_t>(size));
  size_t got = 0;
  // Reads until EOF, but never past the limit (the file may grow while it is read).
  while (true) {
    if (got == text.size()) {
      if (text.size() > max_bytes) break;
      text.resize(std::min<size_t>(static_cast<size_t>(max_bytes) + 1, text.size() + 4096));
    }
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      fail(code, "cannot read {} {}: {}", what, path, errno_string(err));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  if (got > max_bytes) {
    fail(code, "{} {} holds more than the {} bytes allowed for such a file: is it the right file?",
         what, path, max_bytes);
  }
  text.resize(got);
  return text;
}

std::string clip_for_message(std::string_view text, size_t max_chars) {
  std::string out;
  const size_t n = std::min(text.size(), max_chars);
  out.reserve(n + 32);
  for (size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    out.push_back(c < 0x20 || c == 0x7f ? '?' : static_cast<char>(c));
  }
  if (text.size() > max_chars) out += fmt::format("... ({} bytes in all)", text.size());
  return out;
}

nlohmann::json parse_json_strict(const std::string& text, const std::string& where, ExitCode code) {
  using nlohmann::json;
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::string duplicate;
  auto callback = [&](int /*depth*/, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        keys.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto key = parsed.get<std::string>();
        if (!keys.empty() && !keys.back().insert(key).second && duplicate.empty()) {
          duplicate = key;
        }
        break;
      }
      default:
        break;
    }
    return true;
  };
  json out;
  try {
    out = json::parse(text, callback);
  } catch (const std::exception& e) {
    fail(code, "{} is not valid JSON ({}): repair or re-download the file", where,
         clip_for_message(e.what(), 200));
  }
  if (!duplicate.empty()) {
    fail(code,
         "{}: key \"{}\" appears twice in one object (which one is meant is ambiguous): repair "
         "or re-download the file",
         where, clip_for_message(duplicate));
  }
  return out;
}

}  // namespace dnallm
