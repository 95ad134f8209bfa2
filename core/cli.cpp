#include "core/cli.hpp"

#include <cstdio>
#include <iostream>

#include <spdlog/spdlog.h>

#include "core/error.hpp"

namespace dnallm {

void add_config_options(CLI::App& app, ConfigOptions& options) {
  app.add_option("--config,-c", options.config_path, "TOML configuration file");
  app.add_option("--set", options.overrides,
                 "override a key: section.key=value (TOML value or bare word; repeatable)")
      ->type_name("KEY=VALUE")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--metrics-file", options.metrics_file,
                 "write JSON Lines metrics here (same as --set logging.metrics_file=PATH)");
  app.add_option("--log-level", options.log_level,
                 "trace|debug|info|warn|error|critical|off (same as --set logging.level=...)");
  app.add_flag("--print-config", options.print_config,
               "print the resolved configuration as TOML and exit");
}

Config resolve_config(const ConfigOptions& options) {
  std::vector<std::string> overrides;
  if (!options.metrics_file.empty()) {
    overrides.push_back("logging.metrics_file=" + options.metrics_file);
  }
  if (!options.log_level.empty()) overrides.push_back("logging.level=" + options.log_level);
  overrides.insert(overrides.end(), options.overrides.begin(), options.overrides.end());
  return load_config(options.config_path, overrides);
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
  try {
    return body();
  } catch (const Error& e) {
    if (spdlog::default_logger()) {
      spdlog::error("{}", e.what());
      spdlog::default_logger()->flush();
    } else {
      std::cerr << prog << ": " << e.what() << "\n";
    }
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << prog << ": internal error: " << e.what() << "\n";
    return static_cast<int>(ExitCode::kFailure);
  }
}

}  // namespace dnallm
