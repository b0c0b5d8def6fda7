// Internals of WorkerClient shared by its source files (worker/client.cc:
// joining, streams, parameters and recovery; worker/client_step.cc: one
// step; worker/push_pull_round.cc: the step's pushes and pulls). Not for
// anyone else: include worker/client.h.
#ifndef GTOPK_WORKER_CLIENT_INTERNAL_H_
#define GTOPK_WORKER_CLIENT_INTERNAL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "worker/cancellation.h"
#include "worker/client.h"

namespace gtopk {
namespace worker {

// One shard: its channel and, between steps, its open PushPull stream.
struct WorkerClient::ShardConn {
  uint32_t id = 0;
  std::string address;
  uint64_t begin = 0;
  uint64_t end = 0;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Aggregator::Stub> stub;
  // Open stream (both null when closed). The context outlives the stream.
  std::unique_ptr<grpc::ClientContext> context;
  // The context's registration with ClientOptions::cancellation; declared
  // after it so that it ends first.
  std::unique_ptr<Cancellation::Scope> cancel_scope;
  std::unique_ptr<grpc::ClientReaderWriter<v1::Push, v1::Pull>> stream;
  // Set by the step thread when the stream ended (it must be reopened).
  bool broken = false;
};

// Same code, message prefixed with `where`.
inline absl::Status Prefixed(const absl::Status& s, absl::string_view where) {
  return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

}  // namespace worker
}  // namespace gtopk

#endif  // GTOPK_WORKER_CLIENT_INTERNAL_H_
