// AccessControl (server/access.h): authentication by client certificate or
// token, and the role and rank checks of every Aggregator RPC.
#include "server/access.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "grpc/grpc_security_constants.h"
#include "grpcpp/security/auth_context.h"

namespace gtopk {
namespace server {
namespace {

// The roles a certificate common name carries (server/access.h).
bool RoleFromCommonName(absl::string_view cn, Caller* caller) {
  uint32_t number = 0;
  if (absl::StartsWith(cn, kShardCnPrefix)) {
    if (!absl::SimpleAtoi(cn.substr(sizeof(kShardCnPrefix) - 1), &number)) {
      return false;
    }
    caller->shard = true;
    caller->shard_id = number;
    return true;
  }
  if (cn == kWorkerCn) {
    caller->worker = true;
    return true;
  }
  const std::string rank_prefix = absl::StrCat(kWorkerCn, "-");
  if (absl::StartsWith(cn, rank_prefix) &&
      absl::SimpleAtoi(cn.substr(rank_prefix.size()), &number)) {
    caller->worker = true;
    caller->rank = number;
    return true;
  }
  return false;
}

}  // namespace

AccessControl::AccessControl(std::shared_ptr<const TransportSecurity> security,
                             prometheus::Registry& registry)
    : security_(std::move(security)) {
  auto& family = prometheus::BuildCounter()
                     .Name("gtopk_server_auth_failures_total")
                     .Help(
                         "Aggregator calls refused by authentication "
                         "(code=\"unauthenticated\": missing or wrong token "
                         "or certificate) or authorization "
                         "(code=\"permission_denied\": wrong role, rank or "
                         "shard); nothing of them was applied")
                     .Register(registry);
  unauthenticated_ = &family.Add({{"code", "unauthenticated"}});
  permission_denied_ = &family.Add({{"code", "permission_denied"}});
}

absl::Status AccessControl::Denied(std::string message) const {
  permission_denied_->Increment();
  return absl::PermissionDeniedError(std::move(message));
}

absl::StatusOr<Caller> AccessControl::Authenticate(
    const grpc::ServerContext& context) const {
  Caller caller;
  if (security_ == nullptr || !security_->authenticates()) {
    caller.shard = caller.worker = true;
    caller.name = "anyone (no authentication configured)";
    return caller;
  }
  bool from_certificate = false;
  if (security_->tls() == TlsMode::kMutual) {
    // gRPC verified the chain against --tls-ca during the handshake (a
    // client without a valid certificate never gets here).
    std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
    std::vector<grpc::string_ref> cns =
        auth == nullptr ? std::vector<grpc::string_ref>()
                        : auth->FindPropertyValues(GRPC_X509_CN_PROPERTY_NAME);
    if (cns.empty()) {
      unauthenticated_->Increment();
      return absl::UnauthenticatedError(
          "no verified client certificate (the server requires mutual TLS)");
    }
    const absl::string_view cn(cns[0].data(), cns[0].size());
    caller.name = absl::StrCat("certificate CN=", cn);
    if (!RoleFromCommonName(cn, &caller)) {
      return Denied(absl::StrCat(caller.name, " names no gtopk role; expected ",
                                 kShardCnPrefix, "<s>, ", kWorkerCn, " or ",
                                 kWorkerCn, "-<rank>"));
    }
    from_certificate = true;
  }
  if (!security_->worker_token().empty()) {
    const auto& md = context.client_metadata();
    auto it = md.find(kTokenMetadataKey);
    if (it == md.end()) {
      unauthenticated_->Increment();
      return absl::UnauthenticatedError(
          "missing token: the call has no 'authorization: Bearer <token>' "
          "metadata (give the client --token-file)");
    }
    absl::string_view value(it->second.data(), it->second.size());
    constexpr absl::string_view kBearer = "Bearer ";
    if (absl::StartsWith(value, kBearer)) value.remove_prefix(kBearer.size());
    const bool is_worker = ConstantTimeEquals(value, security_->worker_token());
    const bool is_shard = ConstantTimeEquals(value, security_->shard_token());
    if (!is_worker && !is_shard) {
      unauthenticated_->Increment();
      return absl::UnauthenticatedError(
          "wrong token: it matches neither the workers' nor the shards' "
          "token of this cluster");
    }
    if (from_certificate) {
      // The token must belong to the certificate's role.
      if ((caller.shard && !is_shard) || (caller.worker && !is_worker)) {
        return Denied(absl::StrCat(caller.name, " presented the ",
                                   is_shard ? "shards'" : "workers'",
                                   " token, not its own role's"));
      }
    } else {
      caller.shard = is_shard;
      caller.worker = is_worker;
      caller.name = is_shard ? "the shards' token" : "the workers' token";
    }
  }
  return caller;
}

absl::StatusOr<Caller> AccessControl::AllowWorker(
    const grpc::ServerContext& context, const char* rpc,
    std::optional<int64_t> rank, bool shard_ok) const {
  absl::StatusOr<Caller> caller = Authenticate(context);
  if (!caller.ok()) return caller.status();
  if (!caller->worker && !(shard_ok && caller->shard)) {
    return Denied(absl::StrCat(rpc, " is a worker RPC; ", caller->name,
                               " is not a worker"));
  }
  if (rank.has_value()) {
    const absl::Status same = CheckRank(*caller, rpc, *rank);
    if (!same.ok()) return same;
  }
  return caller;
}

absl::Status AccessControl::CheckRank(const Caller& caller, const char* rpc,
                                      int64_t rank) const {
  if (caller.rank.has_value() && int64_t{*caller.rank} != rank) {
    return Denied(absl::StrCat(rpc, " as rank ", rank, ": ", caller.name,
                               " may act only as rank ", *caller.rank));
  }
  return absl::OkStatus();
}

absl::Status AccessControl::AllowShard(const grpc::ServerContext& context,
                                       const char* rpc,
                                       std::optional<uint32_t> shard_id) const {
  absl::StatusOr<Caller> caller = Authenticate(context);
  if (!caller.ok()) return caller.status();
  if (!caller->shard) {
    return Denied(absl::StrCat(rpc, " is a shard-to-shard RPC; ", caller->name,
                               " is not a shard"));
  }
  if (shard_id.has_value() && caller->shard_id.has_value() &&
      *caller->shard_id != *shard_id) {
    return Denied(absl::StrCat(rpc, " for shard ", *shard_id, ": ",
                               caller->name, " is shard ", *caller->shard_id));
  }
  return absl::OkStatus();
}

}  // namespace server
}  // namespace gtopk
