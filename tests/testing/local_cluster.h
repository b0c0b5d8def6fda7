// An in-process gtopk cluster for tests and benchmarks: S AggregatorServers on
// loopback (real gRPC) and helpers to read the servers' parameters back.
#ifndef GTOPK_TESTS_TESTING_LOCAL_CLUSTER_H_
#define GTOPK_TESTS_TESTING_LOCAL_CLUSTER_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtopk/v1/gtopk.grpc.pb.h"
#include "server/aggregator_server.h"
#include "server/server_config.h"

namespace gtopk {
namespace testing {

// A layer-wise cluster's server settings, as the overlap tests use them:
// gTop-k with --selection=layerwise in buckets of `bucket_values` floats,
// the exact selector, delta-varint indices and fp32 values, `density`, a
// 20 s step timeout. With ApplyMode::kServers also lr 1 and no momentum, so
// a step's update is minus the aggregate A/P at the selected indices.
inline server::ServerConfig LayerwiseConfig(int workers, ApplyMode apply,
                                            uint64_t bucket_values,
                                            double density) {
  server::ServerConfig s;
  s.num_workers = workers;
  s.mode = AggregationMode::kGtopk;
  s.selection = SelectionKind::kLayerwise;
  s.bucket_mb = static_cast<double>(bucket_values) * 4.0 / (1 << 20);
  s.selector = "exact";
  s.apply = apply;
  s.index_codec = IndexCodec::kDeltaVarint;
  s.value_codec = ValueCodec::kFp32;
  s.optimizer.density = density;
  if (apply == ApplyMode::kServers) {
    s.optimizer.lr = 1.0f;
    s.optimizer.momentum = 0.0f;
    s.optimizer.momentum_mode = MomentumMode::kNone;
  }
  s.step_timeout = absl::Seconds(20);
  return s;
}

// `count` distinct free loopback ports (bound together, then released; the
// servers bind them right after, so a collision is unlikely and retried).
inline absl::StatusOr<std::vector<int>> PickFreePorts(int count) {
  std::vector<int> fds, ports;
  absl::Status status;
  for (int i = 0; i < count && status.ok(); ++i) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
      status = absl::InternalError("socket() failed");
      break;
    }
    fds.push_back(fd);
    sockaddr_in addr;
    std::memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      status = absl::InternalError("bind() failed");
      break;
    }
    ports.push_back(ntohs(addr.sin_port));
  }
  for (int fd : fds) close(fd);
  if (!status.ok()) return status;
  return ports;
}

// S running shards. `base` supplies everything but shard_id, num_shards
// and peers.
class LocalCluster {
 public:
  // `edit` (may be empty) changes each shard's configuration after its
  // shard_id and peers are set and before it starts, e.g. to route one
  // shard's calls to the leader through a proxy (peers[0]).
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(
      const server::ServerConfig& base, uint32_t num_shards,
      const std::function<void(server::ServerConfig&)>& edit = {}) {
    absl::Status last;
    for (int attempt = 0; attempt < 3; ++attempt) {
      auto ports = PickFreePorts(static_cast<int>(num_shards));
      if (!ports.ok()) return ports.status();
      std::vector<std::string> peers;
      for (int p : *ports) peers.push_back(absl::StrCat("127.0.0.1:", p));
      auto cluster = std::unique_ptr<LocalCluster>(new LocalCluster());
      last = absl::OkStatus();
      for (uint32_t s = 0; s < num_shards && last.ok(); ++s) {
        server::ServerConfig c = base;
        c.shard_id = s;
        c.num_shards = num_shards;
        c.peers = peers;
        if (edit) edit(c);
        auto srv = server::AggregatorServer::Start(c, peers[s]);
        if (!srv.ok()) {
          last = srv.status();
        } else {
          cluster->servers_.push_back(*std::move(srv));
          cluster->configs_.push_back(c);
        }
      }
      if (last.ok()) {
        cluster->peers_ = peers;
        return cluster;
      }
    }
    return last;
  }

  ~LocalCluster() {
    for (auto& s : servers_) {
      if (s != nullptr) s->Shutdown(absl::Milliseconds(200)).IgnoreError();
    }
  }

  const std::string& leader() const { return peers_[0]; }
  const std::vector<std::string>& peers() const { return peers_; }
  server::AggregatorServer& shard(size_t s) { return *servers_[s]; }
  size_t size() const { return servers_.size(); }

  // Stops shard `s` and starts it again on the same address with the same
  // configuration, restoring its checkpoint if it has one. With
  // `write_checkpoint` false no final checkpoint is written: a crash.
  // `while_down` (may be empty) runs between the two, e.g. to replace the
  // shard's checkpoint files. `edit` (may be empty) changes the shard's
  // configuration for this and later restarts (e.g. an operator restarting
  // it with another --lr). Errors: Start's (after a few tries while the
  // port is released).
  absl::Status RestartShard(
      size_t s, bool write_checkpoint,
      const std::function<void()>& while_down = {},
      const std::function<void(server::ServerConfig&)>& edit = {}) {
    servers_[s]
        ->Shutdown(absl::Milliseconds(200), write_checkpoint)
        .IgnoreError();
    servers_[s].reset();
    if (while_down) while_down();
    if (edit) edit(configs_[s]);
    absl::Status last;
    for (int attempt = 0; attempt < 20; ++attempt) {
      auto srv = server::AggregatorServer::Start(configs_[s], peers_[s]);
      if (srv.ok()) {
        servers_[s] = *std::move(srv);
        return absl::OkStatus();
      }
      last = srv.status();
      if (!absl::IsUnavailable(last)) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return last;
  }

  // Downloads every shard's parameters (as worker `rank`) into a vector of
  // length n, and the step every shard reports (-1 if they disagree).
  absl::StatusOr<std::pair<std::vector<float>, int64_t>> ServerParams(
      uint64_t n, uint32_t rank = 0) {
    std::vector<float> out(n, 0.0f);
    int64_t step = -2;
    for (size_t s = 0; s < peers_.size(); ++s) {
      auto stub = v1::Aggregator::NewStub(
          grpc::CreateChannel(peers_[s], grpc::InsecureChannelCredentials()));
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
      v1::DownloadParamsRequest req;
      req.set_rank(rank);
      auto reader = stub->DownloadParams(&ctx, req);
      v1::ParamsChunk chunk;
      while (reader->Read(&chunk)) {
        if (chunk.offset() + chunk.values_size() > n) {
          return absl::InternalError("chunk out of range");
        }
        std::copy(chunk.values().begin(), chunk.values().end(),
                  out.begin() + chunk.offset());
        if (step == -2) step = chunk.step();
        if (step != chunk.step()) step = -1;
      }
      const grpc::Status st = reader->Finish();
      if (!st.ok()) {
        return absl::Status(static_cast<absl::StatusCode>(st.error_code()),
                            st.error_message());
      }
    }
    return std::make_pair(std::move(out), step);
  }

 private:
  LocalCluster() = default;
  std::vector<std::string> peers_;
  std::vector<std::unique_ptr<server::AggregatorServer>> servers_;
  std::vector<server::ServerConfig> configs_;  // by shard, as started
};

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_LOCAL_CLUSTER_H_
