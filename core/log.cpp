#include "core/log.hpp"

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <mutex>

#include <spdlog/sinks/stdout_color_sinks.h>

#include "core/enum_names.hpp"
#include "core/error.hpp"

namespace dnallm {
namespace {
std::mutex g_role_mu;
std::string g_role = "dnallm";  // guarded by g_role_mu

void apply_pattern(int rank) {
  std::string who;
  {
    std::lock_guard<std::mutex> lock(g_role_mu);
    who = g_role;
  }
  std::string id = rank >= 0 ? fmt::format("{}@{}", rank, host_name()) : "@" + host_name();
  spdlog::set_pattern(fmt::format("[%H:%M:%S.%e] [%^%l%$] [{} {}] %v", who, id));
}

// logging.level as spdlog's level; a level's name is the configuration's (cfg::spelling). See
// Note [Enum tables] (core/enum_names.hpp).
constexpr EnumName<cfg::LogLevel, spdlog::level::level_enum> kSpdlogLevels[] = {
    {cfg::LogLevel::kTrace, spdlog::level::trace},
    {cfg::LogLevel::kDebug, spdlog::level::debug},
    {cfg::LogLevel::kInfo, spdlog::level::info},
    {cfg::LogLevel::kWarn, spdlog::level::warn},
    {cfg::LogLevel::kError, spdlog::level::err},
    {cfg::LogLevel::kCritical, spdlog::level::critical},
    {cfg::LogLevel::kOff, spdlog::level::off}};
static_assert(lists_each_in_order<cfg::LogLevel::kOff>(kSpdlogLevels));
}  // namespace

const std::string& host_name() {
  static const std::string name = [] {
    std::array<char, 256> buf{};
    if (gethostname(buf.data(), buf.size() - 1) != 0) return std::string("unknown");
    std::string h(buf.data());
    auto dot = h.find('.');
    return dot == std::string::npos ? h : h.substr(0, dot);
  }();
  return name;
}

spdlog::level::level_enum parse_log_level(const std::string& name) {
  for (const auto& level : kSpdlogLevels) {
    if (name == cfg::spelling(level.value)) return level.name;
  }
  if (name == "warning") return spdlog::level::warn;
  fail(ExitCode::kUsage,
       "unknown log level '{}'; use one of trace, debug, info, warn, error, critical, off", name);
}

spdlog::level::level_enum log_level_of(cfg::LogLevel level) {
  return name_of(kSpdlogLevels, level, spdlog::level::info);
}

void init_logging(const std::string& role, cfg::LogLevel level) {
  init_logging(role, "info");
  spdlog::set_level(log_level_of(level));
}

void init_logging(const std::string& role, const std::string& level) {
  {
    std::lock_guard<std::mutex> lock(g_role_mu);
    g_role = role;
  }
  auto logger = spdlog::stderr_color_mt(role + "-" + std::to_string(::getpid()));
  spdlog::set_default_logger(logger);
  spdlog::set_level(parse_log_level(level));
  spdlog::flush_on(spdlog::level::info);
  apply_pattern(-1);
}

void set_log_identity(int rank) { apply_pattern(rank); }

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  const auto total = static_cast<int64_t>(s + 0.5);
  if (total >= 3600) return fmt::format("{}h{:02}m", total / 3600, (total % 3600) / 60);
  if (total >= 60) return fmt::format("{}m{:02}s", total / 60, total % 60);
  return fmt::format("{}s", total);
}

}  // namespace dnallm
