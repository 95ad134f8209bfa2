#include "core/cli.hpp"

#include <cstdio>
#include <iostream>
#include <new>

#include <spdlog/spdlog.h>

#include "core/error.hpp"

namespace dnallm {

void add_config_file_options(CLI::App& app, ConfigOptions& options,
                             const std::string& config_help) {
  app.add_option("--config,-c", options.config_path, config_help);
  app.add_option("--set", options.overrides,
                 "override a key: section.key=value (TOML value or bare word; repeatable)")
      ->type_name("KEY=VALUE")
      ->take_all()
      ->allow_extra_args(false);
}

void add_config_options(CLI::App& app, ConfigOptions& options) {
  add_config_file_options(app, options, "TOML configuration file");
  app.add_option("--metrics-file", options.metrics_file,
                 "write JSON Lines metrics here (same as --set logging.metrics_file=PATH)");
  app.add_option("--log-level", options.log_level,
                 "trace|debug|info|warn|error|critical|off (same as --set logging.level=...)");
  app.add_flag("--print-config", options.print_config,
               "print the resolved configuration as TOML and exit");
}

CLI::Option* add_key_option(CLI::App& app, ConfigOptions& options, const std::string& flag,
                            const std::string& key, const std::string& help) {
  auto record = [&options, flag, key](const std::string& value) {
    options.key_flags.push_back({key, value, flag + " " + value});
  };
  // The help's type column from the default: "2.0" is a number, "3" an integer.
  const std::string fallback = config_default(key);
  const bool text = fallback.empty() || fallback.front() == '"' || fallback.front() == '[';
  const bool number = fallback.find_first_of(".eE") != std::string::npos;
  return app.add_option_function<std::string>(flag, record, help + " (" + key + ")")
      ->type_name(text     ? "TEXT"
                  : number ? "FLOAT"
                           : "INT")
      ->default_str(fallback);
}

void add_coordinator_key_options(CLI::App& app, ConfigOptions& options,
                                 const std::string& help_prefix) {
  struct Flag {
    const char* flag;
    const char* key;
    const char* help;
  };
  static const Flag kFlags[] = {
      {"--max-membership-changes", "elastic.max_membership_changes",
       "job-wide budget of node deaths and late joins"},
      {"--rdzv-settle", "elastic.settle_s",
       "seconds without a new join before a round closes with at least MIN nodes"},
      {"--heartbeat-timeout", "elastic.heartbeat_timeout_s",
       "seconds of silence before a node is declared dead"},
      {"--hang-timeout", "elastic.step_timeout_s",
       "seconds without step progress before a rank is a hang"},
      {"--join-timeout", "elastic.join_timeout_s",
       "seconds a round may stay below MIN nodes before the job fails"},
  };
  for (const Flag& f : kFlags) add_key_option(app, options, f.flag, f.key, help_prefix + f.help);
}

Config resolve_config(const ConfigOptions& options) {
  std::vector<std::string> overrides;
  if (!options.metrics_file.empty()) {
    overrides.push_back("logging.metrics_file=" + options.metrics_file);
  }
  if (!options.log_level.empty()) overrides.push_back("logging.level=" + options.log_level);
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  Config config = load_config(options.config_path, overrides);
  if (!options.key_flags.empty()) apply_key_overrides(config, options.key_flags);
  return config;
}

int run_main(const std::string& prog, CLI::App& app, int argc, char** argv,
             const std::function<int()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return 0;
  } catch (const CLI::CallForAllHelp&) {
    std::cout << app.help("", CLI::AppFormatMode::All);
    return 0;
  } catch (const CLI::CallForVersion&) {
    std::cout << prog << " " << DNALLM_VERSION << "\n";
    return 0;
  } catch (const CLI::ParseError& e) {
    std::cerr << prog << ": " << e.what() << "; run '" << prog << " --help'\n";
    return static_cast<int>(ExitCode::kUsage);
  }
  // A message that reaches a user is one line of bounded length, whatever a library or a
  // damaged file put into it (Note [Untrusted files]).
  auto one_line = [](const std::string& what) {
    std::string line = what.substr(0, what.find('\n'));
    constexpr size_t kMaxChars = 2000;
    if (line.size() > kMaxChars) {
      line = fmt::format("{}... ({} bytes in all)", line.substr(0, kMaxChars), what.size());
    }
    return line;
  };
  try {
    return body();
  } catch (const Error& e) {
    if (spdlog::default_logger()) {
      spdlog::error("{}", one_line(e.what()));
      spdlog::default_logger()->flush();
    } else {
      std::cerr << prog << ": " << one_line(e.what()) << "\n";
    }
    return e.exit_code();
  } catch (const std::bad_alloc&) {
    std::cerr << prog << ": " << out_of_memory_message("the allocator") << "\n";
    return static_cast<int>(ExitCode::kUsage);
  } catch (const std::exception& e) {
    if (const auto oom = allocation_failure(e.what())) {
      std::cerr << prog << ": " << out_of_memory_message(*oom) << "\n";
      return static_cast<int>(ExitCode::kUsage);
    }
    std::cerr << prog << ": internal error: " << one_line(e.what()) << "\n";
    return static_cast<int>(ExitCode::kFailure);
  }
}

std::optional<std::string> allocation_failure(const std::string& what) {
  // LibTorch's allocators (CPU "DefaultCPUAllocator: can't allocate memory: you tried to
  // allocate N bytes", CUDA "CUDA out of memory. Tried to allocate ...") report through
  // c10::Error, whose what() continues with a stack trace: keep the first line only.
  static const char* const kMarkers[] = {"can't allocate memory", "CUDA out of memory",
                                         "out of memory", "std::bad_alloc"};
  for (const char* marker : kMarkers) {
    if (what.find(marker) == std::string::npos) continue;
    std::string first = what.substr(0, what.find('\n'));
    if (first.size() > 300) first = first.substr(0, 300) + "...";
    return first;
  }
  return std::nullopt;
}

std::string out_of_memory_message(const std::string& detail) {
  return "out of memory (" + detail +
         "): the model, batch or sequence length is too big for this machine; lower "
         "training.micro_batch_size (raise training.grad_accum_steps to keep the global batch), "
         "model.max_seq_length, or model.hidden / model.layers, or shard the optimizer state "
         "(parallel.zero_stage = 1 or 2)";
}

int run_plain_main(const std::string& prog, CLI::App& app, int argc, char** argv,
                   const std::function<int()>& body) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << prog << ": " << e.what() << " (see --help)\n";
    return static_cast<int>(ExitCode::kUsage);
  }
  try {
    return body();
  } catch (const Error& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << prog << ": " << e.what() << "\n";
    return static_cast<int>(ExitCode::kFailure);
  }
}

}  // namespace dnallm
