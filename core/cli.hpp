// Command-line conventions shared by every binary (CLI11).
//
// - `--help` prints the complete help and exits 0.
// - Bad usage prints one line "<prog>: <what>; run '<prog> --help'" and exits 2.
// - A dnallm::Error ends the process with its ExitCode and one logged line.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "core/config.hpp"

namespace dnallm {

// Options every configuration-reading binary accepts.
struct ConfigOptions {
  std::string config_path;             // --config FILE
  std::vector<std::string> overrides;  // --set section.key=value (repeatable)
  std::string metrics_file;            // --metrics-file PATH (= --set logging.metrics_file=PATH)
  std::string log_level;               // --log-level LEVEL (= --set logging.level=LEVEL)
  bool print_config = false;           // --print-config: print resolved TOML and exit 0
  std::vector<KeyOverride> key_flags;  // flags standing for keys, as given (add_key_option)
};

void add_config_options(CLI::App& app, ConfigOptions& options);
// Only --config/-c (help `config_help`) and --set, for binaries with a log level of their own.
void add_config_file_options(CLI::App& app, ConfigOptions& options, const std::string& config_help);

// A flag that stands for one configuration key (dnallm-launch --max-restarts R =
// elastic.max_restarts): its help shows the key's default; given, its value goes through the
// key's checks and overrides the file and --set (resolve_config); absent, the configuration's
// value holds. See Note [Elastic settings] (core/config.hpp).
CLI::Option* add_key_option(CLI::App& app, ConfigOptions& options, const std::string& flag,
                            const std::string& key, const std::string& help);

// The [elastic] flags of whoever hosts the coordinator (dnallm-launch, dnallm-coordinator):
// --max-membership-changes, --rdzv-settle, --heartbeat-timeout, --hang-timeout, --join-timeout;
// `help_prefix` starts each help text.
void add_coordinator_key_options(CLI::App& app, ConfigOptions& options,
                                 const std::string& help_prefix);

// Loads the configuration with the options' precedence: flags standing for keys > --set >
// --metrics-file/--log-level shorthands > file > defaults. Throws Error(kUsage).
Config resolve_config(const ConfigOptions& options);

// The first line of an exception text that reports a failed allocation (LibTorch's CPU or
// CUDA allocator, std::bad_alloc), or nullopt for any other error.
std::optional<std::string> allocation_failure(const std::string& what);
// One sentence for a failed allocation: what was too big and what to lower.
std::string out_of_memory_message(const std::string& detail);

// Runs `body` with the conventions above (a failed allocation exits 2 with
// out_of_memory_message instead of an internal error); returns the process exit code. `parse` is
// called with argc/argv to let CLI11 parse (it throws CLI::ParseError on bad usage).
int run_main(const std::string& prog, CLI::App& app, int argc, char** argv,
             const std::function<int()>& body);

// Runs `body` for the binaries that print their errors as they are, without logging them
// (dnallm-coordinator, dnallm-bench-comm): bad usage prints "<prog>: <what> (see --help)" and
// exits 2; an Error prints "<prog>: <what>" and exits with its code, any other exception the
// same with exit 1.
int run_plain_main(const std::string& prog, CLI::App& app, int argc, char** argv,
                   const std::function<int()>& body);

}  // namespace dnallm
