// dnallm-coordinator: serves the key-value store (coordinator/store_server.hpp) until
// SIGINT or SIGTERM. Normally the node-rank-0 launcher hosts it; this is the standalone form.
#include <csignal>
#include <cstdlib>
#include <iostream>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include "coordinator/store_server.hpp"
#include "core/error.hpp"
#include "core/log.hpp"

int main(int argc, char** argv) {
  using namespace dnallm;
  CLI::App app{"dnallm-coordinator: the job's key-value store and rendezvous service"};
  coordinator::StoreServerOptions options;
  std::string token;
  std::string log_level = "info";
  int port = 29500;
  app.add_option("--host", options.host, "address to bind (default 0.0.0.0)");
  app.add_option("--port", port, "TCP port to listen on; 0 picks a free one (default 29500)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--token", token, "job token clients must present (default: $DNALLM_JOB_TOKEN)");
  app.add_option("--max-frame-bytes", options.max_frame_bytes, "largest accepted frame");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::cerr << "dnallm-coordinator: " << e.what() << " (see --help)\n";
    return static_cast<int>(ExitCode::kUsage);
  }
  try {
    init_logging("coordinator", log_level);
    if (token.empty()) {
      const char* env = std::getenv("DNALLM_JOB_TOKEN");
      if (env != nullptr) token = env;
    }
    if (token.empty())
      spdlog::warn("no job token set (--token or DNALLM_JOB_TOKEN): any client is accepted");
    options.token = token;
    options.port = static_cast<uint16_t>(port);
    coordinator::StoreServer server(options);
    server.start();
    // Print the port on stdout so scripts using --port 0 can read it.
    std::cout << "port " << server.port() << std::endl;

    boost::asio::io_context signals_io;
    boost::asio::signal_set signals(signals_io, SIGINT, SIGTERM);
    signals.async_wait([&](const boost::system::error_code&, int sig) {
      spdlog::info("coordinator: signal {}, stopping", sig);
      server.stop();
    });
    signals_io.run();
    server.join();
    return 0;
  } catch (const Error& e) {
    std::cerr << "dnallm-coordinator: " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "dnallm-coordinator: " << e.what() << "\n";
    return static_cast<int>(ExitCode::kFailure);
  }
}
