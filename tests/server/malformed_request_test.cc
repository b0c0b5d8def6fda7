// Bytes that do not parse as the request's protobuf, sent over real gRPC
// to every RPC of gtopk.v1.Aggregator (issue 42, "Unparseable requests";
// docs/errors.md): each is refused INVALID_ARGUMENT naming the request type,
// never INTERNAL, never an orderly end of a stream (OK), never a misleading
// code. The four inputs are the outside tester's: a bad wire type, a
// truncated varint, a length past the end, and more than 100 nested groups.
// The same inputs are seeds of fuzz/server_requests_fuzz
// (fuzz/corpus/server_requests_fuzz/malformed_*).
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_edge/grpc_edge.h"
#include "gmock/gmock.h"
#include "grpcpp/client_context.h"
#include "grpcpp/impl/codegen/client_unary_call.h"
#include "grpcpp/impl/codegen/rpc_method.h"
#include "grpcpp/impl/codegen/sync_stream.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"
#include "server/aggregator_server.h"
#include "server/server_config.h"

namespace gtopk {
namespace server {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

struct Rpc {
  const char* name;          // method of gtopk.v1.Aggregator
  const char* request_type;  // what the bytes must parse as
  grpc::internal::RpcMethod::RpcType kind;
};

const Rpc kRpcs[] = {
    {"Join", "gtopk.v1.JoinRequest", grpc::internal::RpcMethod::NORMAL_RPC},
    {"GetClusterSpec", "gtopk.v1.JoinRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"CheckMember", "gtopk.v1.MemberCheckRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"ExchangeThreshold", "gtopk.v1.ThresholdRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"CommitStep", "gtopk.v1.CommitRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"GetShardState", "gtopk.v1.ShardStateRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"RollbackShard", "gtopk.v1.RollbackRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"Recover", "gtopk.v1.RecoverRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"AbortStep", "gtopk.v1.AbortStepRequest",
     grpc::internal::RpcMethod::NORMAL_RPC},
    {"DownloadParams", "gtopk.v1.DownloadParamsRequest",
     grpc::internal::RpcMethod::SERVER_STREAMING},
    {"InitParams", "gtopk.v1.ParamsChunk",
     grpc::internal::RpcMethod::CLIENT_STREAMING},
    {"PushPull", "gtopk.v1.Push", grpc::internal::RpcMethod::BIDI_STREAMING},
};

struct Input {
  const char* name;
  std::string bytes;
};

std::vector<Input> Inputs() {
  return {
      {"bad wire type", std::string("\x0f", 1)},  // field 1, wire type 7
      {"truncated varint", std::string("\x08\xff", 2)},
      {"length past the end", std::string("\x0a\x10"
                                          "a",
                                          3)},
      {"101 nested groups",
       std::string(101, '\x0b') + std::string(101, '\x0c')},
  };
}

grpc::ByteBuffer Bytes(const std::string& bytes) {
  grpc::Slice slice(bytes.data(), bytes.size());
  return grpc::ByteBuffer(&slice, 1);
}

// Sends `bytes` as the (first) request message of `rpc`, the way any gRPC
// client of the method would frame it, and returns the call's status.
grpc::Status Send(grpc::Channel* channel, const Rpc& rpc,
                  const std::string& bytes) {
  const std::string path = std::string("/gtopk.v1.Aggregator/") + rpc.name;
  const grpc::internal::RpcMethod method(path.c_str(), rpc.kind);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  const grpc::ByteBuffer request = Bytes(bytes);
  grpc::ByteBuffer response;
  switch (rpc.kind) {
    case grpc::internal::RpcMethod::NORMAL_RPC:
      return grpc::internal::BlockingUnaryCall<grpc::ByteBuffer,
                                               grpc::ByteBuffer>(
          channel, method, &context, request, &response);
    case grpc::internal::RpcMethod::SERVER_STREAMING: {
      std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
          grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(
              channel, method, &context, request));
      while (reader->Read(&response)) {
      }
      return reader->Finish();
    }
    case grpc::internal::RpcMethod::CLIENT_STREAMING: {
      std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
          grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
              channel, method, &context, &response));
      writer->Write(request);
      writer->WritesDone();
      return writer->Finish();
    }
    case grpc::internal::RpcMethod::BIDI_STREAMING: {
      std::unique_ptr<
          grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
          stream(grpc::internal::ClientReaderWriterFactory<
                 grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel, method,
                                                             &context));
      stream->Write(request);
      stream->WritesDone();
      while (stream->Read(&response)) {
      }
      return stream->Finish();
    }
  }
  return grpc::Status(grpc::StatusCode::UNKNOWN, "unreachable");
}

TEST(MalformedRequestTest, EveryRpcRefusesUnparseableBytesAsInvalidArgument) {
  ServerConfig config;
  config.num_workers = 2;
  config.peers = {""};
  auto server = AggregatorServer::Start(config, "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = CreateLimitedChannel((*server)->address(), uint64_t{1} << 20);
  for (const Rpc& rpc : kRpcs) {
    for (const Input& input : Inputs()) {
      SCOPED_TRACE(std::string(rpc.name) + ", " + input.name);
      const grpc::Status status = Send(channel.get(), rpc, input.bytes);
      EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
          << status.error_message();
      EXPECT_THAT(status.error_message(), AllOf(HasSubstr("does not parse as"),
                                                HasSubstr(rpc.request_type)));
    }
  }
  // Nothing of it was taken: the cluster has no members and no parameters.
  EXPECT_EQ((*server)->service()->call_limiter().in_flight(), 0);
}

TEST(MalformedRequestTest, AWellFormedEndOfAStreamIsStillAnOrderlyEnd) {
  // The parse-failure record must not leak into the next stream on the same
  // server thread: after the malformed inputs, a PushPull stream the client
  // simply closes ends OK.
  ServerConfig config;
  config.num_workers = 1;
  config.peers = {""};
  auto server = AggregatorServer::Start(config, "127.0.0.1:0");
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = CreateLimitedChannel((*server)->address(), uint64_t{1} << 20);
  const Rpc& push_pull = kRpcs[11];
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(Send(channel.get(), push_pull, "\x0f").error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    const grpc::internal::RpcMethod method("/gtopk.v1.Aggregator/PushPull",
                                           push_pull.kind);
    std::unique_ptr<
        grpc::ClientReaderWriter<grpc::ByteBuffer, grpc::ByteBuffer>>
        stream(grpc::internal::ClientReaderWriterFactory<
               grpc::ByteBuffer, grpc::ByteBuffer>::Create(channel.get(),
                                                           method, &context));
    stream->WritesDone();
    EXPECT_TRUE(stream->Finish().ok());
  }
}

}  // namespace
}  // namespace server
}  // namespace gtopk
