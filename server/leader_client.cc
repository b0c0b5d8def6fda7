#include "server/leader_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"

namespace gtopk {
namespace server {

v1::ThresholdRequest ToProto(const ThresholdRequest& request) {
  v1::ThresholdRequest p;
  p.set_step(request.step);
  p.set_shard_id(request.shard_id);
  p.set_k(request.k);
  p.set_level(request.level);
  p.mutable_histogram()->Add(request.histogram.begin(),
                             request.histogram.end());
  p.set_epoch(request.epoch);
  return p;
}

ThresholdRequest FromProto(const v1::ThresholdRequest& p) {
  ThresholdRequest r;
  r.step = p.step();
  r.shard_id = p.shard_id();
  r.k = p.k();
  r.level = p.level();
  r.histogram.assign(p.histogram().begin(), p.histogram().end());
  r.epoch = p.epoch();
  return r;
}

v1::ThresholdResponse ToProto(const ThresholdResponse& response) {
  v1::ThresholdResponse p;
  p.set_step(response.step);
  p.set_level(response.level);
  p.set_bucket(response.bucket);
  p.set_greater_total(response.greater_total);
  p.set_kth_key(response.kth_key);
  p.set_ties_to_keep(response.ties_to_keep);
  p.set_done(response.done);
  p.set_keep_all(response.keep_all);
  return p;
}

ThresholdResponse FromProto(const v1::ThresholdResponse& p) {
  ThresholdResponse r;
  r.step = p.step();
  r.level = p.level();
  r.bucket = p.bucket();
  r.greater_total = p.greater_total();
  r.kth_key = p.kth_key();
  r.ties_to_keep = p.ties_to_keep();
  r.done = p.done();
  r.keep_all = p.keep_all();
  return r;
}

grpc::Status CallUntilAdmitted(absl::Time deadline, const char* rpc,
                               const std::function<grpc::Status()>& call) {
  absl::Duration backoff = absl::Milliseconds(5);
  for (int tries = 1;; ++tries) {
    const grpc::Status status = call();
    if (status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
      return status;
    }
    if (absl::Now() + backoff >= deadline) {
      return grpc::Status(
          grpc::StatusCode::UNAVAILABLE,
          absl::StrCat(rpc, " refused until the deadline (", tries,
                       " tries): ", status.error_message()));
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(100));
  }
}

GrpcThresholdExchange::GrpcThresholdExchange(
    std::shared_ptr<grpc::Channel> channel, std::string leader_address)
    : leader_address_(std::move(leader_address)),
      stub_(v1::Aggregator::NewStub(std::move(channel))) {}

namespace {

// A leader RPC's status, code kept, message naming the leader and the RPC.
absl::Status FromLeader(const grpc::Status& status,
                        const std::string& leader_address, const char* rpc) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat("leader ", leader_address, " (", rpc,
                                   "): ", status.error_message()));
}

}  // namespace

absl::StatusOr<ThresholdResponse> GrpcThresholdExchange::Exchange(
    const ThresholdRequest& request, absl::Time deadline) {
  v1::ThresholdResponse response;
  v1::ThresholdRequest wire = ToProto(request);
  wire.set_cluster_fingerprint(fingerprint_.load());
  const grpc::Status status =
      CallUntilAdmitted(deadline, "ExchangeThreshold", [&] {
        grpc::ClientContext context;
        context.set_deadline(
            absl::ToChronoTime(deadline + kLeaderDeadlineSlack));
        return stub_->ExchangeThreshold(&context, wire, &response);
      });
  if (!status.ok()) {
    return FromLeader(status, leader_address_, "ExchangeThreshold");
  }
  return FromProto(response);
}

GrpcCommitVoter::GrpcCommitVoter(std::shared_ptr<grpc::Channel> channel,
                                 std::string leader_address)
    : leader_address_(std::move(leader_address)),
      stub_(v1::Aggregator::NewStub(std::move(channel))) {}

absl::Status GrpcCommitVoter::Vote(int64_t step, uint32_t shard,
                                   absl::Time deadline, uint64_t epoch) {
  v1::CommitRequest request;
  request.set_step(step);
  request.set_shard_id(shard);
  request.set_epoch(epoch);
  request.set_cluster_fingerprint(fingerprint_.load());
  v1::CommitResponse response;
  const grpc::Status status = CallUntilAdmitted(deadline, "CommitStep", [&] {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline + kLeaderDeadlineSlack));
    return stub_->CommitStep(&context, request, &response);
  });
  return FromLeader(status, leader_address_, "CommitStep");
}

}  // namespace server
}  // namespace gtopk
