// A hostile client for the flood test (tests/integration/flood_test.py,
// docs/resource-limits.md): floods one gtopk-server with calls while a real
// cluster trains, and reports how each call ended, as one JSON line on
// stdout.
//
//   gtopk_flood_client streams ADDRESS COUNT SECONDS CONNECTIONS
//     opens COUNT PushPull streams, spread over CONNECTIONS connections, that
//     never push; holds the admitted ones for SECONDS, then cancels them.
//   gtopk_flood_client joins ADDRESS N SECONDS
//     sends Join(requested_rank = -1, n = N) in a loop for SECONDS.
//
// Every call has a deadline (SECONDS + 10 s), so a call the server neither
// admits nor refuses shows up as DEADLINE_EXCEEDED, i.e. a hang.
// Exit 0 after the report; 2 on bad arguments.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/completion_queue.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "gtopk/v1/gtopk.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

const char* CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    default:
      return "?";
  }
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// One channel per connection: a distinct channel argument keeps gRPC from
// sharing one TCP connection between them.
std::shared_ptr<grpc::Channel> Connect(const std::string& address, int id) {
  grpc::ChannelArguments args;
  args.SetInt("gtopk.flood_connection", id);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(),
                                   args);
}

void Report(const char* mode, int calls,
            const std::map<std::string, int>& codes,
            const std::map<std::string, std::string>& sample, double seconds,
            double slowest_refusal_ms, int admitted) {
  std::printf(
      "{\"mode\": \"%s\", \"calls\": %d, \"admitted\": %d, "
      "\"seconds\": %.3f, \"slowest_refusal_ms\": %.1f, \"codes\": {",
      mode, calls, admitted, seconds, slowest_refusal_ms);
  bool first = true;
  for (const auto& [code, count] : codes) {
    std::printf("%s\"%s\": %d", first ? "" : ", ", code.c_str(), count);
    first = false;
  }
  std::printf("}, \"messages\": {");
  first = true;
  for (const auto& [code, message] : sample) {
    std::printf("%s\"%s\": %s", first ? "" : ", ", code.c_str(),
                JsonString(message).c_str());
    first = false;
  }
  std::printf("}}\n");
  std::fflush(stdout);
}

struct Stream {
  grpc::ClientContext context;
  std::unique_ptr<
      grpc::ClientAsyncReaderWriter<gtopk::v1::Push, gtopk::v1::Pull>>
      call;
  grpc::Status status;
  bool finished = false;
  Clock::time_point started;
};

int FloodStreams(const std::string& address, int count, int seconds,
                 int connections) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  std::vector<std::unique_ptr<gtopk::v1::Aggregator::Stub>> stubs;
  for (int c = 0; c < connections; ++c) {
    channels.push_back(Connect(address, c));
    stubs.push_back(gtopk::v1::Aggregator::NewStub(channels.back()));
  }
  grpc::CompletionQueue cq;
  std::vector<std::unique_ptr<Stream>> streams;
  const auto begin = Clock::now();
  const auto deadline =
      std::chrono::system_clock::now() + std::chrono::seconds(seconds + 10);
  for (int i = 0; i < count; ++i) {
    auto s = std::make_unique<Stream>();
    s->context.set_deadline(deadline);
    s->started = Clock::now();
    s->call = stubs[i % connections]->PrepareAsyncPushPull(&s->context, &cq);
    // Tags: 2i = started, 2i+1 = finished.
    s->call->StartCall(reinterpret_cast<void*>(uintptr_t{2} * i));
    s->call->Finish(&s->status, reinterpret_cast<void*>(uintptr_t{2} * i + 1));
    streams.push_back(std::move(s));
  }
  std::map<std::string, int> codes;
  std::map<std::string, std::string> sample;
  double slowest_refusal_ms = 0;
  int finished = 0;
  auto take = [&](void* tag) {
    const uintptr_t t = reinterpret_cast<uintptr_t>(tag);
    if (t % 2 == 0) return;  // started
    Stream& s = *streams[t / 2];
    s.finished = true;
    ++finished;
    const std::string code = CodeName(s.status.error_code());
    ++codes[code];
    if (!sample.count(code)) sample[code] = s.status.error_message();
    if (s.status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      const double ms =
          std::chrono::duration<double, std::milli>(Clock::now() - s.started)
              .count();
      if (ms > slowest_refusal_ms) slowest_refusal_ms = ms;
    }
  };
  // Collect refusals while holding the admitted streams for `seconds`.
  const auto hold_until = begin + std::chrono::seconds(seconds);
  void* tag;
  bool ok;
  while (Clock::now() < hold_until) {
    const auto r = cq.AsyncNext(
        &tag, &ok,
        std::chrono::system_clock::now() + std::chrono::milliseconds(100));
    if (r == grpc::CompletionQueue::GOT_EVENT) take(tag);
  }
  int admitted = 0;
  for (auto& s : streams) {
    if (!s->finished) {
      ++admitted;
      s->context.TryCancel();
    }
  }
  // Codes so far are the refusals (and any early ends); then the cancels.
  while (finished < count) {
    const auto r = cq.AsyncNext(
        &tag, &ok, std::chrono::system_clock::now() + std::chrono::seconds(15));
    if (r != grpc::CompletionQueue::GOT_EVENT) break;
    take(tag);
  }
  Report("streams", count, codes, sample,
         std::chrono::duration<double>(Clock::now() - begin).count(),
         slowest_refusal_ms, admitted);
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return 0;
}

int FloodJoins(const std::string& address, uint64_t n, int seconds) {
  auto stub = gtopk::v1::Aggregator::NewStub(Connect(address, 0));
  std::map<std::string, int> codes;
  std::map<std::string, std::string> sample;
  const auto begin = Clock::now();
  int calls = 0;
  double slowest_ms = 0;
  while (Clock::now() < begin + std::chrono::seconds(seconds)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::seconds(10));
    gtopk::v1::JoinRequest request;
    request.set_requested_rank(-1);
    request.set_n(n);
    gtopk::v1::JoinResponse response;
    const auto t0 = Clock::now();
    const grpc::Status status = stub->Join(&context, request, &response);
    const double ms =
        std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (ms > slowest_ms) slowest_ms = ms;
    ++calls;
    const std::string code = CodeName(status.error_code());
    ++codes[code];
    if (!sample.count(code)) sample[code] = status.error_message();
  }
  Report("joins", calls, codes, sample,
         std::chrono::duration<double>(Clock::now() - begin).count(),
         slowest_ms, 0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "streams" && argc == 6) {
    return FloodStreams(argv[2], std::atoi(argv[3]), std::atoi(argv[4]),
                        std::max(1, std::atoi(argv[5])));
  }
  if (mode == "joins" && argc == 5) {
    return FloodJoins(argv[2], std::strtoull(argv[3], nullptr, 10),
                      std::atoi(argv[4]));
  }
  std::fprintf(stderr,
               "usage: %s streams ADDRESS COUNT SECONDS CONNECTIONS\n"
               "       %s joins ADDRESS N SECONDS\n",
               argv[0], argv[0]);
  return 2;
}
