#include "proto/request_parsing.h"

#include <cstddef>
#include <string>

namespace gtopk {
namespace proto {
namespace {

// This thread's last parse failure; OK when none is pending.
thread_local grpc::Status last_parse_failure;

void Record(const grpc::Status& status) { last_parse_failure = status; }

}  // namespace

grpc::Status ParseRequest(grpc::ByteBuffer* buffer,
                          grpc::protobuf::MessageLite* message) {
  if (buffer == nullptr) {
    grpc::Status status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "the request has no payload (" + message->GetTypeName() + " expected)");
    Record(status);
    return status;
  }
  const size_t bytes = buffer->Length();
  grpc::Status status =
      grpc::GenericDeserialize<grpc::ProtoBufferReader,
                               grpc::protobuf::MessageLite>(buffer, message);
  if (status.ok()) return status;
  if (status.error_code() == grpc::StatusCode::INTERNAL) {
    // gRPC's generic traits say INTERNAL when protobuf refuses the bytes.
    status = grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "the " + std::to_string(bytes) + "-byte message does not parse as " +
            message->GetTypeName() +
            " (a bad wire type, a truncated field, a length past the end or "
            "nesting deeper than 100); nothing was done with it");
  }
  Record(status);
  return status;
}

grpc::Status TakeRequestParseFailure() {
  grpc::Status status = last_parse_failure;
  last_parse_failure = grpc::Status::OK;
  return status;
}

}  // namespace proto
}  // namespace gtopk
