// The real gtopk-server binaries as processes on loopback, with in-process
// WorkerClients: a few steps, parameters compared between workers and
// servers; a shard killed with SIGKILL and restarted from its checkpoint
// serves the same parameters and the cluster carries on; SIGTERM shuts the
// servers down cleanly (exit 0).
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
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/testing/status_matchers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/local_cluster.h"
#include "worker/client.h"

#ifndef GTOPK_SERVER_BINARY
#error "GTOPK_SERVER_BINARY must name the gtopk-server executable"
#endif

namespace gtopk {
namespace {

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

std::vector<float> Random(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The flags of shard `shard` of a cluster on `peers` (all shards, in order)
// with `workers` workers: checkpoints in `dir` every `checkpoint_every`
// steps, density 0.01, then `extra`.
std::vector<std::string> ServerArgs(const std::vector<std::string>& peers,
                                    int shard, int workers,
                                    const std::string& dir,
                                    absl::string_view step_timeout,
                                    int checkpoint_every,
                                    std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      absl::StrCat("--listen=", peers[shard]),
      absl::StrCat("--shard-id=", shard),
      absl::StrCat("--num-shards=", peers.size()),
      absl::StrCat("--workers=", workers),
      absl::StrCat("--peers=", absl::StrJoin(peers, ",")),
      absl::StrCat("--step-timeout=", step_timeout),
      absl::StrCat("--checkpoint-dir=", dir),
      absl::StrCat("--checkpoint-every=", checkpoint_every),
      "--density=0.01"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// `count` loopback addresses on free ports (fewer, with a test failure,
// when none could be picked).
std::vector<std::string> LoopbackPeers(int count) {
  std::vector<std::string> peers;
  auto ports = server::PickFreePorts(count);
  EXPECT_TRUE(ports.ok()) << ports.status();
  if (ports.ok()) {
    for (int p : *ports) peers.push_back(absl::StrCat("127.0.0.1:", p));
  }
  return peers;
}

// A fresh directory /tmp/gtopk_process_<name>_XXXXXX for a test's
// checkpoints, logs and summaries (empty, with a test failure, on error).
std::string MakeTempDir(const std::string& name) {
  std::string path = "/tmp/gtopk_process_" + name + "_XXXXXX";
  if (mkdtemp(path.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp " << path << ": " << std::strerror(errno);
    return "";
  }
  return path;
}

TEST(ProcessTest, RealServersTrainSurviveAKillAndShutDownCleanly) {
  const uint64_t n = 20011;
  const int workers = 2;
  const std::vector<std::string> peers = LoopbackPeers(2);
  ASSERT_EQ(peers.size(), 2u);
  const std::string dir = MakeTempDir("test");
  ASSERT_FALSE(dir.empty());
  auto args = [&](int shard) {
    return ServerArgs(peers, shard, workers, dir, "10s", 1,
                      {"--index-codec=delta-bitpack", "--value-codec=bf16"});
  };
  ServerProcess shard0, shard1;
  ASSERT_TRUE(shard0.Start(args(0)));
  ASSERT_TRUE(shard1.Start(args(1)));

  // Two workers, three steps each, in threads (steps are synchronous).
  std::vector<std::unique_ptr<worker::WorkerClient>> clients(workers);
  std::vector<std::vector<float>> params(workers);
  auto run_steps = [&](int from, int to) {
    std::vector<std::thread> threads;
    std::vector<absl::Status> status(workers);
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        for (int step = from; step < to; ++step) {
          auto stats = clients[w]->Step(Random(n, 100 * step + w), absl::MakeSpan(params[w]));
          if (!stats.ok()) {
            status[w] = stats.status();
            return;
          }
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int w = 0; w < workers; ++w) GTOPK_EXPECT_OK(status[w]) << "worker " << w;
  };
  {
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        worker::ClientOptions o;
        o.leader_address = peers[0];
        o.requested_rank = w;
        o.n = n;
        auto c = worker::WorkerClient::Connect(o);
        ASSERT_TRUE(c.ok()) << c.status();
        clients[w] = *std::move(c);
        params[w] = Random(n, 7);  // rank 0's values initialise the shards
        if (w == 1) std::fill(params[w].begin(), params[w].end(), 0.0f);
        auto next = clients[w]->SynchronizeParameters(absl::MakeSpan(params[w]));
        ASSERT_TRUE(next.ok()) << next.status();
        EXPECT_EQ(*next, 0);
      });
    }
    for (auto& t : threads) t.join();
    ASSERT_TRUE(clients[0] && clients[1]);
  }
  ASSERT_TRUE(BitEqual(params[0], params[1]));
  run_steps(0, 3);
  ASSERT_TRUE(BitEqual(params[0], params[1]));

  // The servers' parameters, downloaded by the live client of `rank` (a
  // second Join of a rank with a live stream is refused).
  auto download = [&](int rank, int64_t expected_step) -> std::vector<float> {
    std::vector<float> p(n, 0.0f);
    auto next = clients[rank]->SynchronizeParameters(absl::MakeSpan(p));
    EXPECT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(next.value_or(-1), expected_step);
    return p;
  };
  // The servers hold the same bits as the workers.
  EXPECT_TRUE(BitEqual(download(1, 3), params[0]));

  // Kill shard 1 without warning and restart it from its checkpoint.
  EXPECT_EQ(shard1.StopWith(SIGKILL, absl::Seconds(10)), 128 + SIGKILL);
  ServerProcess restarted;
  ASSERT_TRUE(restarted.Start(args(1)));
  EXPECT_TRUE(BitEqual(download(1, 3), params[0]))
      << "restarted shard serves different parameters";
  // The workers carry on (their streams to shard 1 are reopened).
  run_steps(3, 5);
  EXPECT_TRUE(BitEqual(params[0], params[1]));
  EXPECT_TRUE(BitEqual(download(1, 5), params[0]));

  // Graceful shutdown: SIGTERM -> exit 0.
  clients.clear();
  EXPECT_EQ(restarted.StopWith(SIGTERM, absl::Seconds(15)), 0);
  EXPECT_EQ(shard0.StopWith(SIGTERM, absl::Seconds(15)), 0);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}

// The repro with the real binary (issue 13, part 2): a shard
// SIGTERMed and restarted with --momentum=0.5 while restoring its
// checkpoint must not serve the running workers; their next step fails with
// FAILED_PRECONDITION naming the flag and both values, nothing applied.
// Before, the restarted shard served and the shards diverged.
TEST(ProcessTest, ShardRestartedWithOtherMomentumIsRefused) {
  using ::gtopk::testing::StatusIs;
  using ::testing::HasSubstr;
  const uint64_t n = 5003;
  const int workers = 2;
  const std::vector<std::string> peers = LoopbackPeers(2);
  ASSERT_EQ(peers.size(), 2u);
  const std::string dir = MakeTempDir("drift");
  ASSERT_FALSE(dir.empty());
  auto args = [&](int shard, const char* momentum) {
    // A short drain: the idle workers' open streams would hold SIGTERM up
    // to the drain timeout.
    return ServerArgs(peers, shard, workers, dir, "5s", 1,
                      {"--momentum-mode=global", momentum,
                       "--drain-timeout=1s"});
  };
  ServerProcess shard0, shard1;
  ASSERT_TRUE(shard0.Start(args(0, "--momentum=0.9")));
  ASSERT_TRUE(shard1.Start(args(1, "--momentum=0.9")));
  std::vector<std::unique_ptr<worker::WorkerClient>> clients(workers);
  std::vector<std::vector<float>> params(workers, Random(n, 3));
  for (int w = 0; w < workers; ++w) {
    worker::ClientOptions o;
    o.leader_address = peers[0];
    o.requested_rank = w;
    o.n = n;
    auto c = worker::WorkerClient::Connect(o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients[w] = *std::move(c);
  }
  for (int w = 0; w < workers; ++w) {
    ASSERT_TRUE(clients[w]->SynchronizeParameters(absl::MakeSpan(params[w])).ok());
  }
  auto step_all = [&](int step) {
    std::vector<absl::Status> status(workers);
    std::vector<std::thread> threads;
    for (int w = 0; w < workers; ++w) {
      threads.emplace_back([&, w] {
        status[w] = clients[w]
                        ->Step(Random(n, 100 * step + w),
                               absl::MakeSpan(params[w]))
                        .status();
      });
    }
    for (auto& t : threads) t.join();
    return status;
  };
  for (int step = 0; step < 3; ++step) {
    for (const absl::Status& st : step_all(step)) GTOPK_ASSERT_OK(st);
  }
  EXPECT_EQ(shard1.StopWith(SIGTERM, absl::Seconds(15)), 0);
  ServerProcess restarted;
  ASSERT_TRUE(restarted.Start(args(1, "--momentum=0.5")));
  const std::vector<std::vector<float>> before = params;
  std::vector<absl::Status> status = step_all(3);
  for (int w = 0; w < workers; ++w) {
    // A stream to the stopped shard 1 that was still open may fail this
    // attempt with UNAVAILABLE first (the client reopens it next time).
    if (absl::IsUnavailable(status[w])) {
      status[w] = clients[w]
                      ->Step(Random(n, 300 + w), absl::MakeSpan(params[w]))
                      .status();
    }
    EXPECT_THAT(status[w], StatusIs(absl::StatusCode::kFailedPrecondition,
                                    HasSubstr("--momentum is 0.5 here but 0.9 "
                                              "on the leader")))
        << "worker " << w;
  }
  for (int w = 0; w < workers; ++w) {
    EXPECT_EQ(clients[w]->next_step(), 3);
    EXPECT_TRUE(BitEqual(params[w], before[w])) << "worker " << w;
  }
  clients.clear();
  EXPECT_EQ(restarted.StopWith(SIGTERM, absl::Seconds(15)), 0);
  EXPECT_EQ(shard0.StopWith(SIGTERM, absl::Seconds(15)), 0);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}

// SIGTERM with a round in progress: the server keeps listening while it
// drains (a health check answers NOT_SERVING, not a refused connection), the
// round completes, the drain ends early (long before --drain-timeout), the
// server exits 0, and its checkpoint holds the drained step.
TEST(ProcessTest, SigtermDrainsTheRoundInProgressReportingNotServing) {
  const uint64_t n = 5003;
  const int workers = 2;
  const std::vector<std::string> peers = LoopbackPeers(1);
  ASSERT_EQ(peers.size(), 1u);
  const std::string& address = peers[0];
  const std::string dir = MakeTempDir("drain");
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> args = {absl::StrCat("--listen=", address),
                                         absl::StrCat("--workers=", workers),
                                         "--step-timeout=30s",
                                         absl::StrCat("--checkpoint-dir=", dir),
                                         "--density=0.01",
                                         "--drain-timeout=40s"};
  auto server = std::make_unique<ServerProcess>();
  ASSERT_TRUE(server->Start(args));
  auto connect = [&](int rank) {
    worker::ClientOptions o;
    o.leader_address = address;
    o.requested_rank = rank;
    o.n = n;
    return worker::WorkerClient::Connect(o);
  };
  std::vector<std::unique_ptr<worker::WorkerClient>> clients;
  std::vector<std::vector<float>> params(workers, Random(n, 7));
  for (int w = 0; w < workers; ++w) {
    auto c = connect(w);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(*std::move(c));
  }
  for (int w = 0; w < workers; ++w) {
    ASSERT_TRUE(
        clients[w]->SynchronizeParameters(absl::MakeSpan(params[w])).ok());
  }
  // Step 0 with both workers, then step 1 with worker 0 only: a round open.
  {
    std::thread t([&] {
      GTOPK_EXPECT_OK(
          clients[1]->Step(Random(n, 11), absl::MakeSpan(params[1])));
    });
    GTOPK_EXPECT_OK(clients[0]->Step(Random(n, 10), absl::MakeSpan(params[0])));
    t.join();
  }
  absl::StatusOr<worker::StepStats> step1_rank0;
  std::thread rank0([&] {
    step1_rank0 = clients[0]->Step(Random(n, 20), absl::MakeSpan(params[0]));
  });
  absl::SleepFor(absl::Milliseconds(300));  // rank 0's push arrives
  int exit_code = -2;
  const absl::Time signalled = absl::Now();
  std::thread stopper(
      [&] { exit_code = server->StopWith(SIGTERM, absl::Seconds(60)); });
  // Draining: still listening, NOT_SERVING.
  bool not_serving = false;
  absl::Status last_check;
  for (int i = 0; i < 100 && !not_serving; ++i) {
    absl::StatusOr<bool> serving =
        server::CheckHealth(address, absl::Seconds(1));
    if (serving.ok() && !*serving) not_serving = true;
    if (!serving.ok()) last_check = serving.status();
    if (!not_serving) absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(not_serving) << "no NOT_SERVING while draining; last error: "
                           << last_check;
  // The round in progress completes during the drain.
  GTOPK_EXPECT_OK(clients[1]->Step(Random(n, 21), absl::MakeSpan(params[1])));
  rank0.join();
  GTOPK_EXPECT_OK(step1_rank0);
  EXPECT_TRUE(BitEqual(params[0], params[1]));
  // The next step is refused, naming the shard, while it drains.
  EXPECT_THAT(clients[0]->Step(Random(n, 30), absl::MakeSpan(params[0])),
              gtopk::testing::StatusIs(
                  absl::StatusCode::kUnavailable,
                  ::testing::HasSubstr("shard 0 is shutting down")));
  EXPECT_FALSE(server::CheckHealth(address, absl::Seconds(1)).value_or(true));
  // The drain ends once the workers closed their streams, not at
  // --drain-timeout.
  clients.clear();
  stopper.join();
  EXPECT_EQ(exit_code, 0);
  EXPECT_LT(absl::Now() - signalled, absl::Seconds(30));

  // The checkpoint holds step 2 (both steps applied) and the same values.
  ServerProcess restarted;
  ASSERT_TRUE(restarted.Start(args));
  auto c = connect(0);
  ASSERT_TRUE(c.ok()) << c.status();
  std::vector<float> downloaded(n, 0.0f);
  auto next = (*c)->SynchronizeParameters(absl::MakeSpan(downloaded));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, 2);
  EXPECT_TRUE(BitEqual(downloaded, params[0]));
  EXPECT_EQ(restarted.StopWith(SIGTERM, absl::Seconds(15)), 0);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}

#ifdef GTOPK_WORKER_BINARY
// A child process with stdout and stderr appended to `log`.
pid_t Spawn(const std::string& binary, const std::vector<std::string>& args,
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
int WaitExit(pid_t pid, absl::Duration timeout) {
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

std::string ReadAllText(const std::string& path) {
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
std::string JsonValue(const std::string& json, const std::string& key) {
  const std::string k = "\"" + key + "\": \"";
  const size_t at = json.find(k);
  if (at == std::string::npos) return "";
  const size_t begin = at + k.size();
  return json.substr(begin, json.find('"', begin) - begin);
}

// The real gtopk-server and gtopk-worker binaries: shard 1 is SIGKILLed two
// steps after its last checkpoint and restarted behind the leader; the
// trainers' failed step goes through Recover, the cluster rolls back to the
// checkpoint, and both trainers finish (exit 0) with parameters equal to
// each other's and to the servers'.
TEST(ProcessTest, TrainersRecoverWhenARestartedShardIsBehind) {
  const int workers = 2;
  const std::vector<std::string> peers = LoopbackPeers(2);
  ASSERT_EQ(peers.size(), 2u);
  const std::string dir = MakeTempDir("recovery");
  ASSERT_FALSE(dir.empty());
  auto server_args = [&](int shard) {
    return ServerArgs(peers, shard, workers, dir, "5s", 5);
  };
  ServerProcess shard0, shard1;
  ASSERT_TRUE(shard0.Start(server_args(0)));
  ASSERT_TRUE(shard1.Start(server_args(1)));
  std::vector<pid_t> pids;
  for (int w = 0; w < workers; ++w) {
    pids.push_back(
        Spawn(GTOPK_WORKER_BINARY,
              {absl::StrCat("--server=", peers[0]), absl::StrCat("--rank=", w),
               "--model=synthetic:3001", "--steps=20", "--compute-ms=100",
               "--step-retries=10", "--rpc-timeout-s=20",
               absl::StrCat("--summary-json=", dir, "/worker-", w, ".json")},
              absl::StrCat(dir, "/worker-", w, ".log")));
  }
  // Kill shard 1 once rank 0 reports step 7 done (checkpoint at step 5).
  const std::string log0 = dir + "/worker-0.log";
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline &&
         ReadAllText(log0).find("step 7/20") == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_NE(ReadAllText(log0).find("step 7/20"), std::string::npos)
      << ReadAllText(log0);
  EXPECT_EQ(shard1.StopWith(SIGKILL, absl::Seconds(10)), 128 + SIGKILL);
  ServerProcess restarted;
  ASSERT_TRUE(restarted.Start(server_args(1)));

  for (int w = 0; w < workers; ++w) {
    EXPECT_EQ(WaitExit(pids[w], absl::Seconds(60)), 0)
        << "worker " << w << " log:\n"
        << ReadAllText(absl::StrCat(dir, "/worker-", w, ".log"));
  }
  const std::string log = ReadAllText(log0);
  EXPECT_NE(log.find("continuing from step 5"), std::string::npos)
      << "no rollback to the checkpoint of step 5:\n"
      << log;
  std::vector<std::string> checksums;
  for (int w = 0; w < workers; ++w) {
    const std::string json =
        ReadAllText(absl::StrCat(dir, "/worker-", w, ".json"));
    const std::string mine = JsonValue(json, "param_checksum");
    EXPECT_FALSE(mine.empty()) << json;
    EXPECT_EQ(mine, JsonValue(json, "server_checksum"))
        << "worker " << w << " differs from the servers";
    checksums.push_back(mine);
  }
  EXPECT_EQ(checksums[0], checksums[1]) << "the replicas differ";
  EXPECT_EQ(restarted.StopWith(SIGTERM, absl::Seconds(15)), 0);
  EXPECT_EQ(shard0.StopWith(SIGTERM, absl::Seconds(15)), 0);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}

// The servers of the recovery tests: checkpoints every 5 steps into `dir`,
// a 3 s step timeout.
std::vector<std::string> RecoveryServerArgs(
    const std::vector<std::string>& peers, int shard, int workers,
    const std::string& dir) {
  return ServerArgs(peers, shard, workers, dir, "3s", 5);
}

// Starts `workers` trainers (default --step-retries) running `steps`
// synthetic steps against the leader peers[0]; logs in dir/worker-<w>.log.
std::vector<pid_t> SpawnTrainers(const std::vector<std::string>& peers,
                                 int workers, int steps,
                                 const std::string& dir) {
  std::vector<pid_t> pids;
  for (int w = 0; w < workers; ++w) {
    pids.push_back(
        Spawn(GTOPK_WORKER_BINARY,
              {absl::StrCat("--server=", peers[0]), absl::StrCat("--rank=", w),
               "--model=synthetic:3001", absl::StrCat("--steps=", steps),
               "--compute-ms=100", "--rpc-timeout-s=20",
               absl::StrCat("--summary-json=", dir, "/worker-", w, ".json")},
              absl::StrCat(dir, "/worker-", w, ".log")));
  }
  return pids;
}

// Waits (up to 30 s) until rank 0's log shows `line`.
bool AwaitLog(const std::string& path, const std::string& line) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    if (ReadAllText(path).find(line) != std::string::npos) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return false;
}

// The leader is SIGKILLed mid-run and restarted 3 s later from its
// checkpoint: with the default --step-retries, every trainer waits for it
// (Recover waits for an unreachable leader within the recovery window, and
// channels reconnect within 1 s), the cluster rolls back to the leader's
// checkpoint, and both trainers finish (exit 0) with the same parameters
// as each other and the servers.
TEST(ProcessTest, TrainersSurviveALeaderRestart) {
  const int workers = 2;
  const std::vector<std::string> peers = LoopbackPeers(2);
  ASSERT_EQ(peers.size(), 2u);
  const std::string dir = MakeTempDir("leader");
  ASSERT_FALSE(dir.empty());
  ServerProcess shard0, shard1;
  ASSERT_TRUE(shard0.Start(RecoveryServerArgs(peers, 0, workers, dir)));
  ASSERT_TRUE(shard1.Start(RecoveryServerArgs(peers, 1, workers, dir)));
  std::vector<pid_t> pids = SpawnTrainers(peers, workers, 20, dir);
  const std::string log0 = dir + "/worker-0.log";
  ASSERT_TRUE(AwaitLog(log0, "step 7/20")) << ReadAllText(log0);
  EXPECT_EQ(shard0.StopWith(SIGKILL, absl::Seconds(10)), 128 + SIGKILL);
  absl::SleepFor(absl::Seconds(3));
  ServerProcess restarted;
  ASSERT_TRUE(restarted.Start(RecoveryServerArgs(peers, 0, workers, dir)));

  for (int w = 0; w < workers; ++w) {
    EXPECT_EQ(WaitExit(pids[w], absl::Seconds(60)), 0)
        << "worker " << w << " log:\n"
        << ReadAllText(absl::StrCat(dir, "/worker-", w, ".log"));
  }
  EXPECT_NE(ReadAllText(log0).find("continuing from step 5"), std::string::npos)
      << "no rollback to the leader's checkpoint of step 5:\n"
      << ReadAllText(log0);
  std::vector<std::string> checksums;
  for (int w = 0; w < workers; ++w) {
    const std::string json =
        ReadAllText(absl::StrCat(dir, "/worker-", w, ".json"));
    const std::string mine = JsonValue(json, "param_checksum");
    EXPECT_FALSE(mine.empty()) << json;
    EXPECT_EQ(mine, JsonValue(json, "server_checksum"))
        << "worker " << w << " differs from the servers";
    checksums.push_back(mine);
  }
  EXPECT_EQ(checksums[0], checksums[1]) << "the replicas differ";
  EXPECT_EQ(restarted.StopWith(SIGTERM, absl::Seconds(15)), 0);
  EXPECT_EQ(shard1.StopWith(SIGTERM, absl::Seconds(15)), 0);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}

// A shard SIGKILLed and not restarted: every trainer exits 1 within the
// documented bound (its step fails, then the recovery window of 3 step
// timeouts ends; 3 s each here, so <= 12 s plus slack), and every one's
// final error names the dead shard, without a repeated "Recover:" prefix.
TEST(ProcessTest, TrainersNameADeadShardWithinTheRecoveryWindow) {
  const int workers = 2;
  const std::vector<std::string> peers = LoopbackPeers(2);
  ASSERT_EQ(peers.size(), 2u);
  const std::string dir = MakeTempDir("dead");
  ASSERT_FALSE(dir.empty());
  ServerProcess shard0, shard1;
  ASSERT_TRUE(shard0.Start(RecoveryServerArgs(peers, 0, workers, dir)));
  ASSERT_TRUE(shard1.Start(RecoveryServerArgs(peers, 1, workers, dir)));
  std::vector<pid_t> pids = SpawnTrainers(peers, workers, 1000, dir);
  const std::string log0 = dir + "/worker-0.log";
  ASSERT_TRUE(AwaitLog(log0, "step 3/1000")) << ReadAllText(log0);
  EXPECT_EQ(shard1.StopWith(SIGKILL, absl::Seconds(10)), 128 + SIGKILL);
  const absl::Time killed = absl::Now();
  for (int w = 0; w < workers; ++w) {
    EXPECT_EQ(WaitExit(pids[w], absl::Seconds(30)), 1);
    const std::string log =
        ReadAllText(absl::StrCat(dir, "/worker-", w, ".log"));
    const size_t last = log.rfind("gtopk-worker: ");
    ASSERT_NE(last, std::string::npos) << log;
    const std::string final_error = log.substr(last);
    EXPECT_NE(final_error.find("shard 1"), std::string::npos)
        << "worker " << w
        << "'s final error does not name shard 1: " << final_error;
    EXPECT_EQ(log.find("Recover: Recover:"), std::string::npos) << log;
  }
  EXPECT_LT(absl::Now() - killed, absl::Seconds(12) + absl::Seconds(4));
  EXPECT_EQ(shard0.StopWith(SIGTERM, absl::Seconds(15)), 0);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}

// An unwritable --summary-json is reported before the run (not after every
// step of it): here the leader does not exist and the join would wait its
// 30 s deadline, so an exit within 10 s naming the flag proves the check
// comes first.
TEST(ProcessTest, TrainerRejectsAnUnwritableSummaryBeforeJoining) {
  const std::string dir = MakeTempDir("summary");
  ASSERT_FALSE(dir.empty());
  const std::vector<std::string> peers = LoopbackPeers(1);
  ASSERT_EQ(peers.size(), 1u);
  const std::string log = dir + "/worker.log";
  const pid_t pid =
      Spawn(GTOPK_WORKER_BINARY,
            {absl::StrCat("--server=", peers[0]),
             "--model=synthetic:100", "--steps=1", "--rpc-timeout-s=30",
             absl::StrCat("--summary-json=", dir, "/no-such-dir/worker.json")},
            log);
  EXPECT_EQ(WaitExit(pid, absl::Seconds(10)), 1) << ReadAllText(log);
  EXPECT_NE(ReadAllText(log).find("--summary-json"), std::string::npos)
      << ReadAllText(log);
  EXPECT_NE(ReadAllText(log).find("no-such-dir/worker.json"), std::string::npos)
      << ReadAllText(log);
  std::string cleanup = "rm -rf " + dir;
  EXPECT_EQ(system(cleanup.c_str()), 0);
}
#else
TEST(ProcessTest, TrainersRecoverWhenARestartedShardIsBehind) {
  GTEST_SKIP() << "gtopk-worker is not built (libtorch-dev missing)";
}
#endif

}  // namespace
}  // namespace gtopk
