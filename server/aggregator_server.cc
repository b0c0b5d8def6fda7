// AggregatorServer and CheckHealth (server/aggregator_server.h): the
// grpc::Server around one shard's AggregatorService, and the grpc.health.v1
// client.
#include "server/aggregator_server.h"

#include <malloc.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/grpc_edge/grpc_edge.h"
#include "common/host_port.h"
#include "common/status_macros.h"
#include "common/transport_security/transport_security.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/stub_options.h"

namespace gtopk {
namespace server {
namespace {

// Every method of the health-only port but grpc.health.v1 (which gRPC's
// default health service answers before a generic service is asked):
// UNIMPLEMENTED, so the plaintext port reveals nothing else. Its presence
// also gives that server the callback queue gRPC needs to start.
class HealthOnlyFallback final : public grpc::CallbackGenericService {
 public:
  grpc::ServerGenericBidiReactor* CreateReactor(
      grpc::GenericCallbackServerContext* /*context*/) override {
    class Refuse final : public grpc::ServerGenericBidiReactor {
     public:
      Refuse() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this is the plaintext health port: only "
                            "grpc.health.v1 is served here"));
      }
      void OnDone() override { delete this; }
    };
    return new Refuse();
  }
};

int ClampToInt(uint64_t v) {
  return static_cast<int>(
      std::min<uint64_t>(v, static_cast<uint64_t>(INT_MAX)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<AggregatorServer>> AggregatorServer::Start(
    ServerConfig config, const std::string& listen_address,
    const std::string& health_listen_address) {
  GTOPK_RETURN_IF_ERROR(ValidateHostPort("listen", listen_address, 0));
  if (!health_listen_address.empty()) {
    GTOPK_RETURN_IF_ERROR(
        ValidateHostPort("health-listen", health_listen_address, 0));
  }
  std::unique_ptr<AggregatorServer> server(new AggregatorServer());
  GTOPK_ASSIGN_OR_RETURN(server->service_,
                         AggregatorService::Create(std::move(config)));
  const int limit = ClampToInt(server->service_->config().max_message_bytes);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // No SO_REUSEPORT: a second server on the same address must fail to
  // start instead of silently sharing the port's connections.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  const std::shared_ptr<const TransportSecurity>& security =
      server->service_->config().security;
  builder.AddListeningPort(listen_address,
                           security != nullptr
                               ? security->ServerCredentials()
                               : grpc::InsecureServerCredentials(),
                           &server->port_);
  builder.SetMaxReceiveMessageSize(limit);
  builder.SetMaxSendMessageSize(limit);
  // Resource bounds (docs/resource-limits.md): HTTP/2 streams per client
  // connection. gRPC's threads (each call of the synchronous API holds one
  // while it runs) follow the calls AggregatorService admits; they are not
  // capped with a grpc::ResourceQuota: with one (SetMaxThreads), gRPC 1.51
  // timed out the 16 MiB download that follows cancelled ones in
  // service_test's ConcurrentDownloadsAreBounded; refused calls return at
  // once, so the threads held are the admitted calls'.
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS,
                             static_cast<int>(EffectiveStreamsPerConnection(
                                 server->service_->config())));
  builder.RegisterService(server->service_.get());
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      interceptors;
  interceptors.push_back(server->service_->metrics().MakeInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    server->shut_down_ = true;
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen_address));
  }
  if (!health_listen_address.empty()) {
    // A second server with no service of ours: gRPC's default health
    // service only, so the plaintext port reveals nothing else.
    server->health_fallback_ = std::make_unique<HealthOnlyFallback>();
    grpc::ServerBuilder health_builder;
    health_builder.RegisterCallbackGenericService(
        server->health_fallback_.get());
    health_builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    health_builder.AddListeningPort(health_listen_address,
                                    grpc::InsecureServerCredentials(),
                                    &server->health_port_);
    server->health_server_ = health_builder.BuildAndStart();
    if (server->health_server_ == nullptr || server->health_port_ == 0) {
      server->health_server_.reset();
      server->Shutdown(absl::ZeroDuration(), /*write_checkpoint=*/false)
          .IgnoreError();
      return absl::UnavailableError(absl::StrCat(
          "cannot listen on --health-listen=", health_listen_address));
    }
  }
  server->trimmer_ = std::thread([raw = server.get()] { raw->TrimLoop(); });
  server->address_ = absl::StrCat(
      listen_address.substr(0, listen_address.rfind(':')), ":", server->port_);
  server->service_->SetOwnAddress(server->address_);
  if (grpc::HealthCheckServiceInterface* health =
          server->server_->GetHealthCheckService()) {
    grpc::HealthCheckServiceInterface* mirror =
        server->health_server_ != nullptr
            ? server->health_server_->GetHealthCheckService()
            : nullptr;
    health->SetServingStatus(true);
    if (mirror != nullptr) mirror->SetServingStatus(true);
    // Not ready while this shard's settings or run identity differ from
    // the leader's (it refuses all work then).
    server->service_->SetReadinessListener(
        [health, mirror](const absl::Status& ready) {
          health->SetServingStatus(ready.ok());
          if (mirror != nullptr) mirror->SetServingStatus(ready.ok());
        });
    // SERVING until a checkpoint write fails, again once one succeeds.
    server->service_->SetCheckpointHealthListener([health, mirror](bool ok) {
      health->SetServingStatus(kCheckpointHealthService, ok);
      if (mirror != nullptr) {
        mirror->SetServingStatus(kCheckpointHealthService, ok);
      }
    });
  }
  return server;
}

AggregatorServer::~AggregatorServer() {
  if (!shut_down_) Shutdown(absl::ZeroDuration()).IgnoreError();
  StopTrimmer();
}

void AggregatorServer::TrimLoop() {
  absl::MutexLock lock(&trim_mu_);
  const auto stop = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(trim_mu_) {
    return trim_stop_;
  };
  while (!trim_mu_.AwaitWithTimeout(absl::Condition(&stop), kTrimInterval)) {
    malloc_trim(0);
  }
}

void AggregatorServer::StopTrimmer() {
  if (!trimmer_.joinable()) return;
  {
    absl::MutexLock lock(&trim_mu_);
    trim_stop_ = true;
  }
  trimmer_.join();
}

absl::Status AggregatorServer::Shutdown(absl::Duration grace,
                                        bool write_checkpoint,
                                        absl::Duration drain) {
  if (shut_down_ || server_ == nullptr) return absl::OkStatus();
  shut_down_ = true;
  service_->SetReadinessListener(nullptr);  // NOT_SERVING from now on
  // Before the drain (in which live workers see "shutting down" and close
  // their streams to recover): the ranks reserved after the restart are
  // those of the workers connected when the shutdown began.
  service_->KeepOnlyLiveMembers();
  if (grpc::HealthCheckServiceInterface* health =
          server_->GetHealthCheckService()) {
    health->SetServingStatus(false);
  }
  if (health_server_ != nullptr) {
    if (grpc::HealthCheckServiceInterface* health =
            health_server_->GetHealthCheckService()) {
      health->SetServingStatus(false);
    }
  }
  if (drain > absl::ZeroDuration()) {
    // Still listening: health checks see NOT_SERVING, and the round in
    // progress can complete.
    service_->BeginDrain();
    service_->AwaitDrained(absl::Now() + drain);
  }
  const absl::Time deadline = absl::Now() + grace;
  absl::Notification drained;
  // Handlers blocked in a step wait do not see gRPC's cancellation: at the
  // deadline, fail their waits so that Shutdown can return.
  std::thread closer([this, deadline, &drained] {
    if (!drained.WaitForNotificationWithDeadline(deadline)) {
      service_->BeginShutdown();
    }
  });
  server_->Shutdown(absl::ToChronoTime(deadline));
  drained.Notify();
  closer.join();
  service_->BeginShutdown();
  server_->Wait();
  if (health_server_ != nullptr) {
    health_server_->Shutdown(absl::ToChronoTime(absl::Now()));
    health_server_->Wait();
  }
  // The health service goes with the server; the final checkpoint's outcome
  // is the return value (gtopk-server's exit code).
  service_->SetCheckpointHealthListener(nullptr);
  if (!write_checkpoint) return absl::OkStatus();
  return service_->WriteCheckpointNow();
}

// ---------------------------------------------------------------------------
// Health check client

absl::StatusOr<bool> CheckHealth(
    const std::string& address, absl::Duration timeout,
    const std::string& service,
    const std::shared_ptr<const TransportSecurity>& security) {
  if (service.size() >= 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("health service name of ", service.size(),
                     " bytes; at most 127 are supported"));
  }
  grpc::GenericStub stub(
      CreateSecureChannel(address, grpc::ChannelArguments(), security));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  // grpc.health.v1.HealthCheckRequest{string service = 1}: no bytes for
  // "", else tag 0x0a, the length (one byte: names are short) and the name.
  std::string request_bytes;
  if (!service.empty()) {
    request_bytes.push_back('\x0a');
    request_bytes.push_back(static_cast<char>(service.size()));
    request_bytes += service;
  }
  grpc::Slice request_slice(request_bytes);
  grpc::ByteBuffer request(&request_slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  absl::Notification done;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                 &request, &response, [&status, &done](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("health check of ", address, ": ",
                                     status.error_message()));
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Valid() && response.Dump(&slices).ok()) {
    for (const grpc::Slice& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  // HealthCheckResponse{ServingStatus status = 1}: read the varint fields,
  // skip anything else; SERVING is 1, and an absent field means UNKNOWN (0).
  uint64_t serving = 0;
  size_t pos = 0;
  auto read_varint = [&bytes, &pos](uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && pos < bytes.size(); shift += 7) {
      const uint8_t b = static_cast<uint8_t>(bytes[pos++]);
      *v |= uint64_t{b & 0x7fu} << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  };
  while (pos < bytes.size()) {
    uint64_t tag = 0, value = 0;
    if (!read_varint(&tag)) break;
    const uint64_t wire_type = tag & 7;
    if (wire_type == 0) {
      if (!read_varint(&value)) break;
      if ((tag >> 3) == 1) serving = value;
    } else if (wire_type == 2) {
      if (!read_varint(&value) || value > bytes.size() - pos) break;
      pos += value;
    } else {
      return absl::InternalError(absl::StrCat("health check of ", address,
                                              ": unexpected wire type ",
                                              wire_type, " in response"));
    }
  }
  return serving == 1;
}

absl::Status ExplainNotServing(
    const std::string& address,
    const std::shared_ptr<const TransportSecurity>& security) {
  auto stub = v1::Aggregator::NewStub(
      CreateLimitedChannel(address, uint64_t{1} << 20, security));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::JoinRequest request;
  request.set_settings_only(true);  // no wait for a worker's Join
  v1::ClusterSpec spec;
  return FromGrpcStatus(stub->GetClusterSpec(&context, request, &spec));
}

}  // namespace server
}  // namespace gtopk
