// Test tooling for in-process cluster tests (tests/integration/): P worker
// clients joined to a LocalCluster and synchronised, the set-up
// most multi-worker tests start from.
#ifndef GTOPK_TESTS_TESTING_JOINED_WORKERS_H_
#define GTOPK_TESTS_TESTING_JOINED_WORKERS_H_

#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "tests/testing/local_cluster.h"
#include "worker/client.h"

namespace gtopk {
namespace testing {

struct JoinedWorkers {
  std::vector<std::unique_ptr<worker::WorkerClient>> clients;  // by rank
  std::vector<std::vector<float>> params;  // each rank's replica, length n
};

// Joins ranks 0..workers-1 of `cluster` (n parameters, rpc timeout 10 s,
// step watchdog margin 500 ms) and synchronises them concurrently: rank 0
// offers `initial` (length n), the others download. Errors: the first
// Connect or SynchronizeParameters error, naming the rank.
inline absl::StatusOr<JoinedWorkers> JoinAndSynchronize(
    const LocalCluster& cluster, int workers,
    const std::vector<float>& initial) {
  JoinedWorkers out;
  for (int w = 0; w < workers; ++w) {
    worker::ClientOptions o;
    o.leader_address = cluster.leader();
    o.requested_rank = w;
    o.n = initial.size();
    o.rpc_timeout = absl::Seconds(10);
    o.step_watchdog_margin = absl::Milliseconds(500);
    auto c = worker::WorkerClient::Connect(o);
    if (!c.ok()) {
      return absl::Status(c.status().code(),
                          absl::StrCat("rank ", w, ": ", c.status().message()));
    }
    out.clients.push_back(*std::move(c));
  }
  out.params.resize(workers);
  std::vector<absl::Status> synced(workers);
  std::vector<std::thread> threads;
  for (int w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      out.params[w] =
          w == 0 ? initial : std::vector<float>(initial.size(), 0.0f);
      synced[w] = out.clients[w]
                      ->SynchronizeParameters(absl::MakeSpan(out.params[w]))
                      .status();
    });
  }
  for (auto& t : threads) t.join();
  for (int w = 0; w < workers; ++w) {
    if (!synced[w].ok()) {
      return absl::Status(synced[w].code(),
                          absl::StrCat("rank ", w, ": ", synced[w].message()));
    }
  }
  return out;
}

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_JOINED_WORKERS_H_
