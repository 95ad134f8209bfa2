#include "hardening_util.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include <fmt/format.h>

namespace dnallm::testing {

std::string tiny_settings(const std::string& ckpt, const std::string& metrics, int steps,
                          int save_steps) {
  return fmt::format(
      "--set model.hidden=32 --set model.layers=2 --set model.heads=2 --set model.ffn=64 "
      "--set model.max_seq_length=64 --set data.train_files=[\\\"data/ecoli_k12_mg1655.fa.gz\\\"] "
      "--set training.max_steps={} --set training.micro_batch_size=6 "
      "--set training.grad_accum_steps=1 --set training.lr=3e-3 "
      "--set training.lr_scheduler=constant --set training.warmup_steps=0 "
      "--set training.logging_steps=1 --set training.seed=7 "
      "--set data.dataloader_num_workers=1 --set parallel.backend=gloo "
      "--set checkpoint.dir={} --set checkpoint.save_steps={} --set checkpoint.keep_last=0 "
      "--set checkpoint.save_final=false --metrics-file {}",
      steps, ckpt, save_steps, metrics);
}

std::string standalone_command(const std::string& ckpt, const std::string& metrics, int steps,
                               int step_delay_ms, const std::string& launcher_flags) {
  return fmt::format(
      "cd {} && exec env DNALLM_TEST_STEP_DELAY_MS={} DNALLM_JOB_TOKEN={} {}dnallm-launch "
      "--standalone --nproc-per-node 2 {} {}",
      kSrc, step_delay_ms, kJobToken, kBin, launcher_flags, tiny_settings(ckpt, metrics, steps, 0));
}

Background::Background(const std::string& cmd, const std::string& log_path) : log_path_(log_path) {
  pid_ = ::fork();
  if (pid_ == 0) {
    ::setpgid(0, 0);
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::setpgid(pid_, pid_);
}

Background::~Background() {
  if (pid_ > 0 && code_ < 0) {
    ::kill(-pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

int Background::wait(std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (code_ < 0) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      break;
    }
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return code_;
}

std::string Background::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool wait_for_text(const std::string& path, const std::string& needle,
                   std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    if (ss.str().find(needle) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::vector<pid_t> processes_matching(const std::string& needle) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (pid == ::getpid()) continue;
    std::ifstream in(entry.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (char& c : cmdline)
      if (c == '\0') c = ' ';
    // Zombies (state Z) are gone for every practical purpose but their reaper.
    std::ifstream stat(entry.path() / "stat");
    std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close_paren = s.rfind(')');
    const char state =
        close_paren != std::string::npos && close_paren + 2 < s.size() ? s[close_paren + 2] : '?';
    if (state != 'Z' && cmdline.find(needle) != std::string::npos) out.push_back(pid);
  }
  return out;
}

std::vector<pid_t> workers_of(pid_t launcher) {
  std::vector<pid_t> out;
  for (pid_t pid : processes_matching("dnallm-train")) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const auto close = s.rfind(')');
    if (close == std::string::npos) continue;
    int ppid = 0;
    char state = 0;
    if (std::sscanf(s.c_str() + close + 2, "%c %d", &state, &ppid) == 2 && ppid == launcher)
      out.push_back(pid);
  }
  return out;
}

}  // namespace dnallm::testing
