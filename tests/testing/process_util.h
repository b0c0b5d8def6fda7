// Test tooling for the multi-process tests (tests/integration/): the real
// gtopk-server and gtopk-worker binaries as child processes on loopback.
#ifndef GTOPK_TESTS_TESTING_PROCESS_UTIL_H_
#define GTOPK_TESTS_TESTING_PROCESS_UTIL_H_

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/testing/local_cluster.h"
#include "tests/testing/reference.h"

#ifndef GTOPK_SERVER_BINARY
#error "GTOPK_SERVER_BINARY must name the gtopk-server executable"
#endif

namespace gtopk {
namespace testing {

// A child gtopk-server. The destructor kills it (SIGKILL) if still running.
class ServerProcess {
 public:
  ServerProcess() = default;
  ServerProcess(const ServerProcess&) = delete;
  ServerProcess& operator=(const ServerProcess&) = delete;
  ~ServerProcess() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }

  // Starts the binary and waits (up to 20 s) for its "listening on" line.
  ::testing::AssertionResult Start(const std::vector<std::string>& args) {
    int pipefd[2];
    if (pipe(pipefd) != 0) return ::testing::AssertionFailure() << "pipe";
    pid_ = fork();
    if (pid_ < 0) return ::testing::AssertionFailure() << "fork";
    if (pid_ == 0) {
      dup2(pipefd[1], STDOUT_FILENO);
      close(pipefd[0]);
      close(pipefd[1]);
      std::vector<char*> argv;
      std::string binary = GTOPK_SERVER_BINARY;
      argv.push_back(binary.data());
      std::vector<std::string> copy = args;
      for (std::string& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
    close(pipefd[1]);
    out_ = pipefd[0];
    std::string seen;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char buf[256];
      const ssize_t got = read(out_, buf, sizeof(buf));
      if (got <= 0) break;
      seen.append(buf, got);
      if (seen.find("listening on") != std::string::npos &&
          seen.find('\n', seen.find("listening on")) != std::string::npos) {
        return ::testing::AssertionSuccess();
      }
    }
    return ::testing::AssertionFailure()
           << "gtopk-server did not report listening; output: " << seen;
  }

  // Sends `signal` and waits up to `timeout` for the exit; returns the exit
  // status (or -1 on timeout, after which the process is killed).
  int StopWith(int signal, absl::Duration timeout) {
    kill(pid_, signal);
    const absl::Time deadline = absl::Now() + timeout;
    int status = 0;
    while (absl::Now() < deadline) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
};

// The flags of shard `shard` of a cluster on `peers` (all shards, in order)
// with `workers` workers: checkpoints in `dir` every `checkpoint_every`
// steps, density 0.01, plaintext (--tls=off, said explicitly: --tls is
// required), then `extra`.
inline std::vector<std::string> ServerArgs(
    const std::vector<std::string>& peers, int shard, int workers,
    const std::string& dir, absl::string_view step_timeout,
    int checkpoint_every, std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      absl::StrCat("--listen=", peers[shard]),
      absl::StrCat("--shard-id=", shard),
      absl::StrCat("--num-shards=", peers.size()),
      absl::StrCat("--workers=", workers),
      absl::StrCat("--peers=", absl::StrJoin(peers, ",")),
      absl::StrCat("--step-timeout=", step_timeout),
      absl::StrCat("--checkpoint-dir=", dir),
      absl::StrCat("--checkpoint-every=", checkpoint_every),
      "--density=0.01",
      "--tls=off"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// `count` loopback addresses on free ports (fewer, with a test failure,
// when none could be picked).
inline std::vector<std::string> LoopbackPeers(int count) {
  std::vector<std::string> peers;
  auto ports = PickFreePorts(count);
  EXPECT_TRUE(ports.ok()) << ports.status();
  if (ports.ok()) {
    for (int p : *ports) peers.push_back(absl::StrCat("127.0.0.1:", p));
  }
  return peers;
}

// A fresh directory /tmp/gtopk_process_<name>_XXXXXX for a test's
// checkpoints, logs and summaries (empty, with a test failure, on error).
inline std::string MakeTempDir(const std::string& name) {
  std::string path = "/tmp/gtopk_process_" + name + "_XXXXXX";
  if (mkdtemp(path.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << path << ": " << std::strerror(errno);
    return "";
  }
  return path;
}

// Spawn and friends: child processes with their output in a log file.
// A child process with stdout and stderr appended to `log`.
inline pid_t Spawn(const std::string& binary,
                   const std::vector<std::string>& args,
                   const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, STDOUT_FILENO);
      dup2(fd, STDERR_FILENO);
      close(fd);
    }
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    std::string b = binary;
    argv.push_back(b.data());
    for (std::string& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(b.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// The exit code, or -1 (after SIGKILL) when it takes longer than `timeout`.
inline int WaitExit(pid_t pid, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int status = 0;
  while (absl::Now() < deadline) {
    if (waitpid(pid, &status, WNOHANG) == pid) {
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
  return -1;
}

inline std::string ReadAllText(const std::string& path) {
  std::string out;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buf[4096];
    size_t got;
    while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, got);
    std::fclose(f);
  }
  return out;
}

// The string value of "key" in a flat JSON object (the trainer's summary).
inline std::string JsonValue(const std::string& json, const std::string& key) {
  const std::string k = "\"" + key + "\": \"";
  const size_t at = json.find(k);
  if (at == std::string::npos) return "";
  const size_t begin = at + k.size();
  return json.substr(begin, json.find('"', begin) - begin);
}

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_PROCESS_UTIL_H_
