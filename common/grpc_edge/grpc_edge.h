// The gRPC edge, one place for the server and the worker client: the
// conversion between absl::Status (used everywhere inside gtopk) and
// grpc::Status (on the wire) in both directions, and the client channels with
// explicit message-size limits and a short reconnect backoff that every peer
// connection uses (shard -> leader, worker -> leader and shards).
//
// Everything here is a pure function of its arguments: no state, safe to call
// from any thread.
#ifndef GTOPK_COMMON_GRPC_EDGE_H_
#define GTOPK_COMMON_GRPC_EDGE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/support/channel_arguments.h"
#include "grpcpp/support/status.h"

namespace gtopk {

// Longest status message sent over the wire, in bytes. gRPC carries the
// message in the trailers, and a client refuses trailers over its metadata
// limit (8 KiB by default) with RESOURCE_EXHAUSTED -- which a worker does
// not retry -- so a long message (a step timeout naming thousands of
// missing workers, a forwarded AbortStep reason) must not reach the wire
// whole.
inline constexpr size_t kMaxStatusMessageBytes = 2048;

// `message` when it fits kMaxStatusMessageBytes; otherwise its head and
// tail with the number of bytes elided between them (at most
// kMaxStatusMessageBytes in all). Pure.
std::string BoundedStatusMessage(absl::string_view message);

// absl::Status -> grpc::Status, the one conversion at a server's edge: the
// same code (the numeric values of both enums agree, 0..16) and the same
// message, bounded by kMaxStatusMessageBytes (BoundedStatusMessage). An OK
// status becomes grpc::Status::OK (its message, if any, is dropped). Pure.
grpc::Status ToGrpcStatus(const absl::Status& status);

// grpc::Status -> absl::Status, the one conversion of a peer's answer: same
// code and message, unbounded (what the peer sent). An OK status becomes
// absl::OkStatus(). Pure.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Reconnect backoff of every channel made by CreateLimitedChannel: the first
// retry after kReconnectBackoffMin, growing to at most kReconnectBackoffMax.
// gRPC's default (1 s growing 1.6x, up to 120 s) would leave a peer waiting
// long after a restarted leader or shard is back (docs/recovery.md). The
// worker client's Recover retries wait within the same bounds.
inline constexpr absl::Duration kReconnectBackoffMin = absl::Milliseconds(100);
inline constexpr absl::Duration kReconnectBackoffMax = absl::Milliseconds(1000);

// The channel arguments CreateLimitedChannel uses: send and receive message
// limits of `max_message_bytes` (clamped to INT_MAX, gRPC's int), and the
// reconnect backoff above (GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS and
// GRPC_ARG_MIN_RECONNECT_BACKOFF_MS = kReconnectBackoffMin,
// GRPC_ARG_MAX_RECONNECT_BACKOFF_MS = kReconnectBackoffMax). Pure; exposed
// so that tests can read the arguments back.
grpc::ChannelArguments LimitedChannelArguments(uint64_t max_message_bytes);

// A channel to `address` (host:port) with LimitedChannelArguments(
// max_message_bytes): messages up to that size pass in both directions, also
// above gRPC's 4 MB default when configured. The channel connects lazily, on
// the first call, and reconnects after a failure every 100 ms growing to at
// most 1 s. Never fails here: an unreachable or malformed address shows up as
// UNAVAILABLE on the first call. The caller shares ownership of the channel
// (grpc::Channel is thread-safe; stubs made from it may be used from any
// thread).
//
// With `security` (common/transport_security/transport_security.h; null:
// plaintext) the channel uses its credentials (TLS, mTLS) and sends its
// outgoing token on every call.
class TransportSecurity;
std::shared_ptr<grpc::Channel> CreateLimitedChannel(
    const std::string& address, uint64_t max_message_bytes,
    const std::shared_ptr<const TransportSecurity>& security = nullptr);

}  // namespace gtopk

#endif  // GTOPK_COMMON_GRPC_EDGE_H_
