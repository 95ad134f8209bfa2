// dnallm-coordinator: serves the key-value store (coordinator/store_server.hpp) and the
// elastic membership service (coordinator/elastic_service.hpp) until SIGINT or SIGTERM, or
// until the elastic job is over (exit 0 when it succeeded, 4 when it failed). Normally the
// node-rank-0 launcher hosts it; this is the standalone form (docs/elastic.md).
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>
#include <thread>

#include <CLI/CLI.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/signal_set.hpp>

#include "coordinator/elastic_config.hpp"
#include "coordinator/elastic_service.hpp"
#include "coordinator/net.hpp"
#include "coordinator/store_server.hpp"
#include "core/cli.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/worker_env.hpp"

namespace {

// The address other nodes reach this one by: the first non-loopback IPv4 address the host
// name resolves to, else 127.0.0.1 (logged either way).
std::string host_address() {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  std::string address;
  for (const auto& a : dnallm::coordinator::resolve_ipv4(name)) {
    if (a.rfind("127.", 0) != 0) {
      address = a;
      break;
    }
  }
  if (address.empty()) {
    spdlog::warn(
        "no --host, no MASTER_ADDR, and host name '{}' has no non-loopback IPv4 "
        "address: listening on 127.0.0.1 only (pass --host)",
        name);
    return "127.0.0.1";
  }
  spdlog::info(
      "no --host and no MASTER_ADDR: binding {}, the address of host '{}' (pass --host "
      "to choose another, --host 0.0.0.0 for every interface)",
      address, name);
  return address;
}

// The token in `path`'s first line if the file exists; otherwise a new one written there
// (mode 0600) for the agents to read with --token-file.
std::string token_from_file(const std::string& path) {
  if (std::ifstream in(path); in) {
    std::string token;
    DNALLM_CHECK(std::getline(in, token) && !token.empty(), dnallm::ExitCode::kUsage,
                 "--token-file {}: the file exists but its first line holds no token; remove it "
                 "to have a new token generated",
                 path);
    spdlog::info("job token read from {}", path);
    return token;
  }
  const std::string token = dnallm::coordinator::generate_job_token();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  DNALLM_CHECK(fd >= 0, dnallm::ExitCode::kUsage,
               "--token-file {}: cannot create it: {}; choose a writable path", path,
               std::strerror(errno));
  const std::string line = token + "\n";
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  ::close(fd);
  DNALLM_CHECK(ok, dnallm::ExitCode::kUsage, "--token-file {}: cannot write it", path);
  spdlog::info(
      "job token generated and written to {} (mode 0600): start the agents with --token-file {} "
      "(or DNALLM_JOB_TOKEN set to its content)",
      path, path);
  return token;
}

using namespace dnallm;

struct CoordinatorArgs {
  coordinator::StoreServerOptions server;
  std::string token;
  std::string token_file = "dnallm-job.token";
  bool no_token = false;
  std::string log_level = "info";
  int port = 29500;
  coordinator::ElasticServiceOptions elastic;
  ConfigOptions config;  // [elastic] and the flags standing for its keys
  bool serve_forever = false;
};

void add_options(CLI::App& app, CoordinatorArgs& a) {
  app.add_option("--host", a.server.host,
                 "address to bind (default: $MASTER_ADDR, else this host's address; "
                 "0.0.0.0 only when given)");
  app.add_option("--port", a.port, "TCP port to listen on; 0 picks a free one (default 29500)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--token", a.token, "job token clients must present (default: $DNALLM_JOB_TOKEN)");
  app.add_option("--token-file", a.token_file,
                 "without --token or $DNALLM_JOB_TOKEN: read the token from this file, or "
                 "generate one and write it there (mode 0600) for the agents' --token-file")
      ->capture_default_str();
  app.add_flag("--no-token", a.no_token,
               "serve any client without a job token (insecure: anyone who reaches the port "
               "can join or disturb the job)");
  app.add_option("--max-frame-bytes", a.server.max_frame_bytes, "largest accepted frame");
  app.add_option("--log-level", a.log_level, "trace|debug|info|warn|error");
}

// [elastic] from --config/--set, and the flags standing for its keys (given flags win).
void add_elastic_options(CLI::App& app, CoordinatorArgs& a) {
  add_config_file_options(app, a.config,
                          "the job's TOML configuration: its [elastic] section sets what the "
                          "flags below do not (docs/config.md)");
  add_key_option(app, a.config, "--min-nodes", "elastic.min_nodes",
                 "elastic: fewest nodes a round closes with");
  add_key_option(app, a.config, "--max-nodes", "elastic.max_nodes",
                 "elastic: most nodes in a generation");
  add_key_option(app, a.config, "--max-restarts", "elastic.max_restarts",
                 "elastic: job-wide budget of worker failures and hangs");
  add_coordinator_key_options(app, a.config, "elastic: ");
  app.add_flag("--serve-forever", a.serve_forever,
               "keep serving after the elastic job ended (until SIGINT/SIGTERM)");
}

// The job token: --token, else $DNALLM_JOB_TOKEN, else --token-file's (none with --no-token).
std::string resolve_token(const CoordinatorArgs& a) {
  std::string token = a.token;
  if (token.empty()) token = job_token_of();
  DNALLM_CHECK(!(a.no_token && !token.empty()), ExitCode::kUsage,
               "--no-token contradicts the job token given by --token or DNALLM_JOB_TOKEN");
  if (a.no_token) {
    spdlog::warn("--no-token: any client that reaches this coordinator is served");
  } else if (token.empty()) {
    token = token_from_file(a.token_file);
  }
  return token;
}

// The bind address: --host, else $MASTER_ADDR, else this host's address.
std::string resolve_host(const CLI::App& app, const CoordinatorArgs& a) {
  std::string host = a.server.host;
  if (app.count("--host") == 0) {
    const char* master = std::getenv("MASTER_ADDR");
    host = master != nullptr && *master != '\0' ? std::string(master) : host_address();
  }
  if (host == "0.0.0.0" || host == "::") {
    spdlog::warn("--host {}: listening on every interface of this node", host);
  }
  return host;
}

// Blocks until SIGINT/SIGTERM or (without --serve-forever) until the elastic job is over and
// every live agent has its outcome (bounded by the heartbeat timeout).
void serve_until_done(coordinator::ElasticService& service, std::chrono::milliseconds deliver,
                      bool serve_forever) {
  // The signal watcher and the job-outcome watcher each end the io loop below.
  boost::asio::io_context signals_io;
  boost::asio::signal_set signals(signals_io, SIGINT, SIGTERM);
  signals.async_wait([&](const boost::system::error_code& ec, int sig) {
    if (ec) return;
    spdlog::info("coordinator: signal {}, stopping", sig);
    signals_io.stop();
  });
  std::atomic<bool> done{false};
  std::thread outcome_watcher;
  if (!serve_forever) {
    outcome_watcher = std::thread([&] {
      while (!done.load()) {
        if (service.view("").terminal()) {
          service.wait_outcome_delivered(deliver);
          signals_io.stop();
          return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    });
  }
  signals_io.run();
  done.store(true);
  if (outcome_watcher.joinable()) outcome_watcher.join();
}

int run(const CLI::App& app, CoordinatorArgs& a) {
  init_logging("coordinator", a.log_level);
  coordinator::StoreServerOptions options = a.server;
  options.token = resolve_token(a);
  options.host = resolve_host(app, a);
  options.port = static_cast<uint16_t>(a.port);
  a.elastic.state = coordinator::elastic_options(resolve_config(a.config).elastic);
  // The service outlives the server's io thread (which runs its handlers): on any exit
  // from this scope the server is destroyed (stopped, joined) first.
  std::unique_ptr<coordinator::ElasticService> service_holder;
  coordinator::StoreServer server(options);
  service_holder = std::make_unique<coordinator::ElasticService>(server, a.elastic);
  coordinator::ElasticService& service = *service_holder;
  server.start();
  service.start();
  // Print the port on stdout so scripts using --port 0 can read it.
  std::cout << "port " << server.port() << std::endl;
  serve_until_done(service, a.elastic.state.heartbeat_timeout, a.serve_forever);
  const coordinator::JobView outcome = service.view("");
  service.stop();
  server.stop();
  service.join();
  server.join();
  if (outcome.phase == coordinator::JobPhase::kFailed) {
    std::cerr << "dnallm-coordinator: the job failed; root cause: " << outcome.root_cause << "\n";
    return static_cast<int>(outcome.exit_code);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dnallm-coordinator: the job's key-value store and rendezvous service"};
  CoordinatorArgs args;
  add_options(app, args);
  add_elastic_options(app, args);
  return run_plain_main("dnallm-coordinator", app, argc, argv, [&] { return run(app, args); });
}
