// Logging through spdlog with a "rank@host" prefix on every line.
//
// Call init_logging() once at the start of main(); later set_log_identity() when the rank
// becomes known (after rendezvous). Thread-safe: spdlog's default logger is used.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

#include "core/config.hpp"

namespace dnallm {

// Parses "trace|debug|info|warn|error|critical|off"; throws Error(kUsage) otherwise.
spdlog::level::level_enum parse_log_level(const std::string& name);

// logging.level as spdlog's level.
spdlog::level::level_enum log_level_of(cfg::LogLevel level);

// Installs a stderr logger named by `role` (e.g. "launch", "train") with level `level`.
void init_logging(const std::string& role, const std::string& level = "info");
void init_logging(const std::string& role, cfg::LogLevel level);

// Sets the prefix to "<role> <rank>@<host>" (rank < 0: "<role> @<host>").
void set_log_identity(int rank);

// The short host name of this machine (cached).
const std::string& host_name();

// A duration for progress lines ("42s", "3m07s", "2h05m"); "?" when negative or not finite.
std::string format_duration(double seconds);

}  // namespace dnallm
