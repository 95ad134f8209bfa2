// Ownership of a checkpoint directory (checkpoint/dir_lock.hpp) and the resume rules that
// keep a run from going back in time: the newest committed step wins over LATEST, a
// manifest must belong to its directory, newer steps are set aside, failed writes leave no
// temporary files. Lock holders are real processes (fork).
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "checkpoint/commit.hpp"
#include "checkpoint/dir_lock.hpp"
#include "checkpoint/durable_io.hpp"
#include "checkpoint/manifest.hpp"
#include "checkpoint/reader.hpp"
#include "checkpoint/reshard.hpp"
#include "checkpoint/shard_file.hpp"
#include "core/error.hpp"
#include "test_util.hpp"

namespace dnallm::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::error_of;
using testing::make_data;
using testing::spec;
using testing::TempDir;

std::vector<uint8_t> save(const fs::path& root, int64_t step) {
  auto w = make_data(DType::kFloat32, 64, static_cast<uint64_t>(step));
  save_single(root, {step, 1, 0, {{"step", step}}},
              {{spec("w", DType::kFloat32, {64}), 0, 64, w.data()}}, {});
  return w;
}

// A child process that takes the lock, reports through a pipe, and holds it until killed.
struct LockHolder {
  pid_t pid = -1;
  explicit LockHolder(const fs::path& dir) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      char ok = 'n';
      try {
        auto lock = DirLock::acquire(dir);
        ok = 'y';
        if (::write(fds[1], &ok, 1) != 1) ::_exit(3);
        ::pause();
      } catch (...) {
        if (::write(fds[1], &ok, 1) != 1) ::_exit(3);
      }
      ::_exit(0);
    }
    ::close(fds[1]);
    char c = 0;
    EXPECT_EQ(::read(fds[0], &c, 1), 1);
    EXPECT_EQ(c, 'y');
    ::close(fds[0]);
  }
  void kill_now() {
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    pid = -1;
  }
  ~LockHolder() {
    if (pid > 0) kill_now();
  }
};

TEST(CheckpointDirLockTest, ASecondJobIsRefusedNamingTheHolder) {
  TempDir tmp;
  LockHolder holder(tmp.path());
  const std::string msg = error_of([&] { DirLock::acquire(tmp.path()); }, ExitCode::kUsage);
  EXPECT_NE(msg.find("in use by another job"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pid " + std::to_string(holder.pid)), std::string::npos) << msg;
  EXPECT_NE(msg.find("another checkpoint.dir"), std::string::npos) << msg;
  // The refused attempt leaves the holder's line alone (it is not its lock).
  std::ifstream in(tmp.path() / kLockName);
  std::string line;
  std::getline(in, line);
  EXPECT_NE(line.find("pid " + std::to_string(holder.pid)), std::string::npos) << line;
}

TEST(CheckpointDirLockTest, ALockLeftByADeadHolderIsTakenOver) {
  TempDir tmp;
  {
    LockHolder holder(tmp.path());
    holder.kill_now();  // SIGKILL: no cleanup ran; the lock file still names it
  }
  std::ifstream in(tmp.path() / kLockName);
  std::string line;
  std::getline(in, line);
  EXPECT_NE(line.find("pid"), std::string::npos) << "the dead holder's line is gone: " << line;
  auto lock = DirLock::acquire(tmp.path());
  std::ifstream again(tmp.path() / kLockName);
  std::getline(again, line);
  EXPECT_NE(line.find("pid " + std::to_string(::getpid())), std::string::npos) << line;
}

TEST(CheckpointDirLockTest, ReleasedOnDestruction) {
  TempDir tmp;
  { auto lock = DirLock::acquire(tmp.path()); }
  EXPECT_NO_THROW(DirLock::acquire(tmp.path()));
}

TEST(CheckpointDirValidationTest, UnusableDirectoriesAreUsageErrorsAtStart) {
  TempDir tmp;
  const std::string key = "checkpoint.dir";
  EXPECT_NE(error_of([&] { validate_checkpoint_dir("", key); }, ExitCode::kUsage).find("empty"),
            std::string::npos);
  std::ofstream(tmp.path() / "a_file") << "x";
  EXPECT_NE(error_of([&] { validate_checkpoint_dir(tmp.path() / "a_file", key); }, ExitCode::kUsage)
                .find("not a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { validate_checkpoint_dir(tmp.path() / std::string(300, 'x'), key); },
                     ExitCode::kUsage)
                .find("characters long"),
            std::string::npos);
  std::string deep = tmp.path().string();
  while (deep.size() < 5000) deep += "/abcdefgh";
  EXPECT_NE(
      error_of([&] { validate_checkpoint_dir(deep, key); }, ExitCode::kUsage).find("shorter path"),
      std::string::npos);
  if (::geteuid() != 0) {  // root writes anywhere
    fs::create_directories(tmp.path() / "ro");
    fs::permissions(tmp.path() / "ro", fs::perms::owner_read | fs::perms::owner_exec);
    EXPECT_NE(error_of([&] { validate_checkpoint_dir(tmp.path() / "ro", key); }, ExitCode::kUsage)
                  .find("not writable"),
              std::string::npos);
    fs::permissions(tmp.path() / "ro", fs::perms::owner_all);
  }
  validate_checkpoint_dir(tmp.path() / "new" / "nested", key);
  EXPECT_TRUE(fs::is_directory(tmp.path() / "new" / "nested"));
  EXPECT_TRUE(fs::is_empty(tmp.path() / "new" / "nested")) << "the write probe was left behind";
}

TEST(CheckpointResumeTest, TheNewestCommittedStepWinsOverAStaleLatest) {
  TempDir tmp;
  save(tmp.path(), 10);
  auto newest = save(tmp.path(), 20);
  // LATEST could not be replaced (disk full between manifest and LATEST), or was restored.
  write_file_durable(tmp.path() / kLatestName, step_dir_name(10) + "\n");
  auto r = find_resume(tmp.path(), cfg::Resume::automatic());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->step(), 20);
  EXPECT_EQ(r->read_tensor("w"), newest);
  EXPECT_EQ(CheckpointReader::open(tmp.path()).step(), 20);
  // A LATEST naming nothing committed changes nothing either.
  write_file_durable(tmp.path() / kLatestName, "garbage\n");
  EXPECT_EQ(find_resume(tmp.path(), cfg::Resume::automatic())->step(), 20);
}

TEST(CheckpointResumeTest, AManifestThatDoesNotBelongToItsDirectoryIsDamaged) {
  TempDir tmp;
  auto good = save(tmp.path(), 10);
  save(tmp.path(), 20);
  // step 999's manifest inside step_000000020 (copied or edited).
  const auto dir = tmp.path() / step_dir_name(20);
  auto j = nlohmann::json::parse(std::ifstream(dir / kManifestName));
  j["step"] = 999;
  std::ofstream(dir / kManifestName) << j.dump();
  const std::string msg = error_of([&] { read_manifest(dir); }, ExitCode::kCheckpointCorrupt);
  EXPECT_NE(msg.find("says step 999"), std::string::npos) << msg;
  auto r = find_resume(tmp.path(), cfg::Resume::automatic());
  ASSERT_TRUE(r);
  EXPECT_EQ(r->step(), 10);
  EXPECT_EQ(r->read_tensor("w"), good);
}

TEST(CheckpointResumeTest, StepsNewerThanTheStartAreSetAsideNotOverwritten) {
  TempDir tmp;
  save(tmp.path(), 10);
  auto kept = save(tmp.path(), 20);
  fs::create_directories(tmp.path() / step_dir_name(30));  // a crashed save: no manifest
  std::ofstream(tmp.path() / step_dir_name(30) / "shard_00001.dnc") << "stale";
  auto moved = set_aside_newer_steps(tmp.path(), 10);
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_FALSE(fs::exists(tmp.path() / step_dir_name(20)));
  EXPECT_FALSE(fs::exists(tmp.path() / step_dir_name(30)));
  EXPECT_EQ(list_committed(tmp.path()).back().first, 10);
  EXPECT_EQ(latest_step_dir(tmp.path())->filename(), step_dir_name(10));
  // The superseded step is intact, readable where it was moved.
  EXPECT_EQ(CheckpointReader::open(moved[0]).read_tensor("w"), kept);
  // A run continuing from 10 now writes step 20 afresh.
  save(tmp.path(), 20);
  EXPECT_EQ(find_resume(tmp.path(), cfg::Resume::automatic())->step(), 20);
}

// A failed durable write (the disk fills up: RLIMIT_FSIZE in a forked child) leaves no
// LATEST.tmp / manifest.json.tmp behind.
TEST(CheckpointResumeTest, AFailedDurableWriteLeavesNoTemporaryFile) {
  TempDir tmp;
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    struct rlimit lim {
      4096, 4096
    };
    ::setrlimit(RLIMIT_FSIZE, &lim);
    try {
      write_file_durable(tmp.path() / kLatestName, std::string(100000, 'x'));
    } catch (const Error&) {
      ::_exit(7);
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7);
  for (const auto& e : fs::directory_iterator(tmp.path())) ADD_FAILURE() << "left " << e.path();
}

TEST(CheckpointReshardBoundTest, AnAbsurdWorldSizeWritesNothing) {
  TempDir tmp;
  save(tmp.path() / "src", 5);
  auto src = CheckpointReader::open(tmp.path() / "src");
  const std::string msg =
      error_of([&] { reshard(src, tmp.path() / "out", 1000000, {}); }, ExitCode::kUsage);
  EXPECT_NE(msg.find("must be between 1 and 64"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(tmp.path() / "out" / step_dir_name(5)));
  // 65 shards of a 64-element tensor: one would be empty.
  error_of([&] { reshard(src, tmp.path() / "out", 65, {}); }, ExitCode::kUsage);
  EXPECT_NO_THROW(reshard(src, tmp.path() / "out", 64, {}));
  // Not over an existing step.
  error_of([&] { reshard(src, tmp.path() / "out", 2, {}); }, ExitCode::kUsage);
}

}  // namespace
}  // namespace dnallm::checkpoint
