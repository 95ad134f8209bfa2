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

#include "coordinator/elastic_service.hpp"
#include "coordinator/net.hpp"
#include "coordinator/store_server.hpp"
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

}  // namespace

int main(int argc, char** argv) {
  using namespace dnallm;
  CLI::App app{"dnallm-coordinator: the job's key-value store and rendezvous service"};
  coordinator::StoreServerOptions options;
  std::string token;
  std::string token_file = "dnallm-job.token";
  bool no_token = false;
  std::string log_level = "info";
  int port = 29500;
  coordinator::ElasticServiceOptions elastic;
  double settle_s = 2.0, heartbeat_timeout_s = 10.0, hang_timeout_s = 300.0, join_timeout_s = 600.0;
  bool serve_forever = false;
  app.add_option("--host", options.host,
                 "address to bind (default: $MASTER_ADDR, else this host's address; "
                 "0.0.0.0 only when given)");
  app.add_option("--port", port, "TCP port to listen on; 0 picks a free one (default 29500)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--token", token, "job token clients must present (default: $DNALLM_JOB_TOKEN)");
  app.add_option("--token-file", token_file,
                 "without --token or $DNALLM_JOB_TOKEN: read the token from this file, or "
                 "generate one and write it there (mode 0600) for the agents' --token-file")
      ->capture_default_str();
  app.add_flag("--no-token", no_token,
               "serve any client without a job token (insecure: anyone who reaches the port "
               "can join or disturb the job)");
  app.add_option("--max-frame-bytes", options.max_frame_bytes, "largest accepted frame");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  app.add_option("--min-nodes", elastic.state.min_nodes,
                 "elastic: fewest nodes a round closes with")
      ->capture_default_str();
  app.add_option("--max-nodes", elastic.state.max_nodes, "elastic: most nodes in a generation")
      ->capture_default_str();
  app.add_option("--max-restarts", elastic.state.max_restarts,
                 "elastic: job-wide budget of worker failures and hangs")
      ->capture_default_str();
  app.add_option("--max-membership-changes", elastic.state.max_membership_changes,
                 "elastic: job-wide budget of node deaths and late joins")
      ->capture_default_str();
  app.add_option("--rdzv-settle", settle_s,
                 "elastic: seconds without a join before a round closes with >= min nodes")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", heartbeat_timeout_s,
                 "elastic: seconds of silence before a node is declared dead")
      ->capture_default_str();
  app.add_option("--hang-timeout", hang_timeout_s,
                 "elastic: seconds without step progress before a rank is a hang")
      ->capture_default_str();
  app.add_option("--join-timeout", join_timeout_s,
                 "elastic: seconds a round may stay below min nodes before the job fails")
      ->capture_default_str();
  app.add_flag("--serve-forever", serve_forever,
               "keep serving after the elastic job ended (until SIGINT/SIGTERM)");
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
    if (token.empty()) token = job_token_of();
    DNALLM_CHECK(!(no_token && !token.empty()), ExitCode::kUsage,
                 "--no-token contradicts the job token given by --token or DNALLM_JOB_TOKEN");
    if (no_token) {
      spdlog::warn("--no-token: any client that reaches this coordinator is served");
    } else if (token.empty()) {
      token = token_from_file(token_file);
    }
    options.token = token;
    if (app.count("--host") == 0) {
      const char* master = std::getenv("MASTER_ADDR");
      if (master != nullptr && *master != '\0') {
        options.host = master;
      } else {
        options.host = host_address();
      }
    }
    if (options.host == "0.0.0.0" || options.host == "::") {
      spdlog::warn("--host {}: listening on every interface of this node", options.host);
    }
    options.port = static_cast<uint16_t>(port);
    auto ms = [](double s) { return std::chrono::milliseconds(static_cast<long long>(s * 1000)); };
    elastic.state.settle = ms(settle_s);
    elastic.state.heartbeat_timeout = ms(heartbeat_timeout_s);
    elastic.state.step_timeout = ms(hang_timeout_s);
    elastic.state.join_timeout = ms(join_timeout_s);
    // The service outlives the server's io thread (which runs its handlers): on any exit
    // from this scope the server is destroyed (stopped, joined) first.
    std::unique_ptr<coordinator::ElasticService> service_holder;
    coordinator::StoreServer server(options);
    service_holder = std::make_unique<coordinator::ElasticService>(server, elastic);
    coordinator::ElasticService& service = *service_holder;
    server.start();
    service.start();
    // Print the port on stdout so scripts using --port 0 can read it.
    std::cout << "port " << server.port() << std::endl;

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
            // Give every live agent the outcome (bounded), then end the io loop.
            service.wait_outcome_delivered(elastic.state.heartbeat_timeout);
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
  } catch (const Error& e) {
    std::cerr << "dnallm-coordinator: " << e.what() << "\n";
    return e.exit_code();
  } catch (const std::exception& e) {
    std::cerr << "dnallm-coordinator: " << e.what() << "\n";
    return static_cast<int>(ExitCode::kFailure);
  }
}
