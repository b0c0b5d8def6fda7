// How the gtopk.v1 request messages are parsed off the wire (issue 42,
// "Unparseable requests"; docs/errors.md).
//
// gRPC parses a request with SerializationTraits<T>::Deserialize before any
// handler runs. Its generic protobuf traits answer bytes that do not parse
// (a bad wire type, a truncated varint, a length past the end, nesting deeper
// than protobuf's limit of 100) with INTERNAL and an empty message on a unary
// call, and make a stream's Read() return false as if the client had closed
// it. Remote input must never cause INTERNAL, and a malformed push must not
// look like an orderly end of the stream, so the request types of the
// gtopk.v1.Aggregator service get traits of their own:
//
//   * unary and server-streaming calls: gRPC answers INVALID_ARGUMENT naming
//     the message type, its size and what cannot be parsed, before the
//     handler runs (nothing is read, registered or applied);
//   * client- and bidi-streams (InitParams, PushPull): Read() returns false
//     as before, and TakeRequestParseFailure() on the handler's thread then
//     returns that INVALID_ARGUMENT, which the handler ends the stream with.
//
// This header is force-included (-include) in every C++ translation unit of
// the gtopk_proto target and of every target linking it
// (proto/CMakeLists.txt), so that every use of these traits -- the
// generated stubs and handlers included -- sees the same specialisation.
// Serialisation is gRPC's own (GenericSerialize), byte for byte.
#ifndef GTOPK_PROTO_REQUEST_PARSING_H_
#define GTOPK_PROTO_REQUEST_PARSING_H_

#include <grpcpp/impl/codegen/proto_utils.h>

namespace gtopk {
namespace v1 {
class AbortStepRequest;
class CommitRequest;
class DownloadParamsRequest;
class JoinRequest;
class MemberCheckRequest;
class ParamsChunk;
class Push;
class RecoverRequest;
class RollbackRequest;
class ShardStateRequest;
class ThresholdRequest;
}  // namespace v1

namespace proto {

// Parses `buffer` into `message` as gRPC's generic protobuf traits do
// (ZeroCopyInputStream, no extra copy), clearing `buffer`. On failure:
// INVALID_ARGUMENT, e.g. "the 17-byte message does not parse as
// gtopk.v1.JoinRequest (a bad wire type, a truncated field, a length past
// the end or nesting deeper than 100); nothing was done with it", also kept
// for TakeRequestParseFailure on this thread. Thread-safe (the record is
// thread_local).
grpc::Status ParseRequest(grpc::ByteBuffer* buffer,
                          grpc::protobuf::MessageLite* message);

// The parse failure ParseRequest last recorded on this thread, and forgets
// it; OK when there is none. A streaming handler calls it once when Read()
// returns false (a parse failure, or the client's end of the stream), and
// once when it starts (a stale record of an earlier call on this thread).
grpc::Status TakeRequestParseFailure();

}  // namespace proto
}  // namespace gtopk

// The streamed request types parse through their own type
// (ServerReader<ParamsChunk>, ServerReaderWriter<Pull, Push>); every request
// type gets the traits, whichever way a handler reads it.
#define GTOPK_REQUEST_SERIALIZATION_TRAITS(Type)                              \
  template <>                                                                 \
  class grpc::SerializationTraits<::gtopk::v1::Type, void> {                  \
   public:                                                                    \
    static grpc::Status Serialize(const grpc::protobuf::MessageLite& msg,     \
                                  grpc::ByteBuffer* bb, bool* own_buffer) {   \
      return grpc::GenericSerialize<grpc::ProtoBufferWriter,                  \
                                    grpc::protobuf::MessageLite>(msg, bb,     \
                                                                 own_buffer); \
    }                                                                         \
    static grpc::Status Deserialize(grpc::ByteBuffer* buffer,                 \
                                    grpc::protobuf::MessageLite* msg) {       \
      return ::gtopk::proto::ParseRequest(buffer, msg);                       \
    }                                                                         \
  };

// The generated unary handlers and stubs parse through their base type
// (RpcMethodHandler<..., grpc::protobuf::MessageLite, ...>), so the base
// type gets the same traits; the message names the concrete type.
template <>
class grpc::SerializationTraits<grpc::protobuf::MessageLite, void> {
 public:
  static grpc::Status Serialize(const grpc::protobuf::MessageLite& msg,
                                grpc::ByteBuffer* bb, bool* own_buffer) {
    return grpc::GenericSerialize<grpc::ProtoBufferWriter,
                                  grpc::protobuf::MessageLite>(msg, bb,
                                                               own_buffer);
  }
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer,
                                  grpc::protobuf::MessageLite* msg) {
    return ::gtopk::proto::ParseRequest(buffer, msg);
  }
};

GTOPK_REQUEST_SERIALIZATION_TRAITS(AbortStepRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(CommitRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(DownloadParamsRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(JoinRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(MemberCheckRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(ParamsChunk)
GTOPK_REQUEST_SERIALIZATION_TRAITS(Push)
GTOPK_REQUEST_SERIALIZATION_TRAITS(RecoverRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(RollbackRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(ShardStateRequest)
GTOPK_REQUEST_SERIALIZATION_TRAITS(ThresholdRequest)

#undef GTOPK_REQUEST_SERIALIZATION_TRAITS

#endif  // GTOPK_PROTO_REQUEST_PARSING_H_
