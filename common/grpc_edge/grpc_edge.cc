#include "common/grpc_edge/grpc_edge.h"

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "common/transport_security/transport_security.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace gtopk {

std::string BoundedStatusMessage(absl::string_view message) {
  if (message.size() <= kMaxStatusMessageBytes) return std::string(message);
  // The head says what failed, the tail often the cause; keep both.
  constexpr size_t kTail = 256;
  const size_t head = kMaxStatusMessageBytes - kTail - 64;
  return absl::StrCat(message.substr(0, head), " ... [",
                      message.size() - head - kTail, " bytes elided] ... ",
                      message.substr(message.size() - kTail));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      BoundedStatusMessage(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

grpc::ChannelArguments LimitedChannelArguments(uint64_t max_message_bytes) {
  grpc::ChannelArguments args;
  const int limit = static_cast<int>(
      std::min<uint64_t>(max_message_bytes, static_cast<uint64_t>(INT_MAX)));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  const int min_ms =
      static_cast<int>(absl::ToInt64Milliseconds(kReconnectBackoffMin));
  const int max_ms =
      static_cast<int>(absl::ToInt64Milliseconds(kReconnectBackoffMax));
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, min_ms);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, min_ms);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, max_ms);
  return args;
}

std::shared_ptr<grpc::Channel> CreateLimitedChannel(
    const std::string& address, uint64_t max_message_bytes,
    const std::shared_ptr<const TransportSecurity>& security) {
  return CreateSecureChannel(
      address, LimitedChannelArguments(max_message_bytes), security);
}

}  // namespace gtopk
