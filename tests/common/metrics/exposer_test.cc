// The HTTP exposer (common/metrics/exposer.h): GET /metrics over a raw
// socket, keep-alive and idle connections that must not starve other
// scrapers, bind errors as Status, host names and IPv6. Moved from
// tests/common/metrics_test.cc (issue 44: tests mirror sources).
#include "common/metrics/exposer.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"
#include "prometheus/registry.h"
#include "tests/testing/exposition.h"

namespace gtopk {
namespace metrics {
namespace {

using ::gtopk::testing::ParseExposition;
using ::gtopk::testing::Promtool;
using ::gtopk::testing::Sample;
using ::gtopk::testing::Serialize;
using ::gtopk::testing::ValueOf;
using ::testing::HasSubstr;
using ::testing::Not;

// A connection to 127.0.0.1:port (-1 on failure) with a receive timeout.
int Connect(int port, int timeout_s) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  timeval tv{timeout_s, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

struct HttpResponse {
  int status = 0;  // 0: no (complete) response
  std::string headers;
  std::string body;
  bool closed = false;  // the server closed the connection (not a timeout)
};

// GET `path` on an open connection; reads until the server closes it or
// the receive timeout expires. The request asks to keep the connection.
HttpResponse Get(int fd, const std::string& path) {
  const std::string request = "GET " + path +
                              " HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              "Connection: keep-alive\r\n\r\n";
  HttpResponse r;
  if (send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    return r;
  }
  std::string raw;
  char buffer[4096];
  ssize_t got;
  while ((got = recv(fd, buffer, sizeof buffer, 0)) > 0)
    raw.append(buffer, got);
  r.closed = got == 0;
  const size_t end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos) return r;
  r.status = std::atoi(raw.c_str() + 9);
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  return r;
}

HttpResponse Get(int port, const std::string& path, int timeout_s) {
  const int fd = Connect(port, timeout_s);
  if (fd < 0) return {};
  HttpResponse r = Get(fd, path);
  close(fd);
  return r;
}

TEST(ExposerTest, ServesMetricsOverHttp) {
  auto registry = std::make_shared<prometheus::Registry>();
  prometheus::BuildCounter()
      .Name("served_total")
      .Help("h")
      .Register(*registry)
      .Add({{"k", "a\"b"}})
      .Increment(4);
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> exposer =
      StartExposer("127.0.0.1:0");
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  (*exposer)->RegisterCollectable(registry);
  const int port = BoundPort(**exposer);
  ASSERT_GT(port, 0);
  HttpResponse response = Get(port, "/metrics", 10);
  ASSERT_EQ(response.status, 200) << response.headers;
  EXPECT_THAT(response.headers, HasSubstr("Content-Type: text/plain"));
  EXPECT_EQ(
      ValueOf(ParseExposition(response.body), "served_total", {{"k", "a\"b"}}),
      4);
  // prometheus-cpp's own families ride along (docs/metrics.md).
  EXPECT_THAT(response.body, HasSubstr("# TYPE exposer_scrapes_total counter"));
  std::string output;
  EXPECT_EQ(Promtool(response.body, &output), 0) << output;
  EXPECT_EQ(Get(port, "/other", 10).status, 404);

  // A second exposer on the same port: UNAVAILABLE naming the address, not
  // an exception.
  const std::string taken = "127.0.0.1:" + std::to_string(port);
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> second =
      StartExposer(taken);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(second.status().message()), HasSubstr(taken));
  // A collectable that went away is skipped.
  registry.reset();
  response = Get(port, "/metrics", 10);
  ASSERT_EQ(response.status, 200);
  EXPECT_THAT(response.body, Not(HasSubstr("served_total")));
}

// An exposer on a free loopback port serving one counter, served_total 1.
struct ServingCounter {
  std::shared_ptr<prometheus::Registry> registry =
      std::make_shared<prometheus::Registry>();
  std::unique_ptr<prometheus::Exposer> exposer;
  int port = 0;
  void Start() {
    prometheus::BuildCounter()
        .Name("served_total")
        .Help("h")
        .Register(*registry)
        .Add({})
        .Increment(1);
    absl::StatusOr<std::unique_ptr<prometheus::Exposer>> started =
        StartExposer("127.0.0.1:0");
    ASSERT_TRUE(started.ok()) << started.status();
    exposer = *std::move(started);
    exposer->RegisterCollectable(registry);
    port = BoundPort(*exposer);
  }
};

// Scrapers that keep their connection open (Prometheus does; an HA pair is
// two of them) and connections that send nothing must not hold the
// exposer's two threads: a scrape after them is answered, and well within a
// 3 s scrape timeout.
TEST(ExposerTest, KeepAliveAndIdleConnectionsDoNotStarveOthers) {
  ServingCounter serving;
  ASSERT_NO_FATAL_FAILURE(serving.Start());
  const int port = serving.port;
  std::vector<int> held;
  for (int i = 0; i < kExposerThreads; ++i) {
    const int fd = Connect(port, 10);
    ASSERT_GE(fd, 0);
    const HttpResponse r = Get(fd, "/metrics");  // asks for keep-alive
    EXPECT_EQ(r.status, 200);
    // The exposer ends every connection after its response (civetweb with
    // keep-alive off closes it; prometheus-cpp writes no Connection header).
    EXPECT_TRUE(r.closed);
    held.push_back(fd);  // left open on our side
  }
  for (int i = 0; i < kExposerThreads; ++i) {
    held.push_back(Connect(port, 10));  // idle: never sends a request
    ASSERT_GE(held.back(), 0);
  }
  const auto start = std::chrono::steady_clock::now();
  const HttpResponse r = Get(port, "/metrics", 3);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_EQ(r.status, 200) << "not served within 3 s";
  EXPECT_LT(seconds, kExposerRequestTimeoutMs / 1000.0 + 0.5);
  for (int fd : held) close(fd);
}

TEST(ExposerTest, RejectsBadAddresses) {
  for (const char* bad :
       {"", "nohostport", "127.0.0.1:65536", "127.0.0.1:x", ":80",
        "127.0.0.1:", "127.0.0.1:+80", "127.0.0.1:80s"}) {
    EXPECT_EQ(StartExposer(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
  // Well-formed but not bindable: UNAVAILABLE with the address.
  for (const char* unbindable :
       {"no-such-host.invalid:0", "192.0.2.1:0" /* TEST-NET-1 */}) {
    const absl::Status s = StartExposer(unbindable).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << unbindable;
    EXPECT_THAT(std::string(s.message()), HasSubstr(unbindable));
  }
}

// Host names bind (to an IPv4 address when civetweb has no IPv6, so
// "localhost" works either way). IPv6 literals bind where civetweb has
// IPv6 and the host has it on loopback; where civetweb lacks it (Debian
// 12's build) they are INVALID_ARGUMENT saying so, not the misleading
// "port in use" of a failed bind.
TEST(ExposerTest, BindsHostNamesAndIpv6WhereTheServerHasIt) {
  absl::StatusOr<std::unique_ptr<prometheus::Exposer>> named =
      StartExposer("localhost:0");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_GT(BoundPort(**named), 0);
  for (const char* address : {"[::1]:0", "::1:0", "[::]:0"}) {
    absl::StatusOr<std::unique_ptr<prometheus::Exposer>> exposer =
        StartExposer(address);
    if (!ExposerSupportsIpv6()) {
      EXPECT_EQ(exposer.status().code(), absl::StatusCode::kInvalidArgument)
          << address;
      EXPECT_THAT(std::string(exposer.status().message()),
                  HasSubstr("no IPv6 support"))
          << address;
      continue;
    }
    if (!exposer.ok()) {
      // A host without IPv6 on loopback (some containers).
      EXPECT_EQ(exposer.status().code(), absl::StatusCode::kUnavailable);
      continue;
    }
    EXPECT_GT(BoundPort(**exposer), 0) << address;
  }
}

// The tester's input: 20 connections that never send a request, then a
// scrape. With 2 threads and a 2 s request timeout it was served after
// 20 s (a Kubernetes probe times out at 5 s, a Prometheus scrape at 10 s).
TEST(ExposerTest, ManyIdleConnectionsDelayAScrapeLittle) {
  ServingCounter serving;
  ASSERT_NO_FATAL_FAILURE(serving.Start());
  const int port = serving.port;
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) {
    idle.push_back(Connect(port, 10));
    ASSERT_GE(idle.back(), 0);
  }
  const auto start = std::chrono::steady_clock::now();
  const HttpResponse r = Get(port, "/metrics", 4);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_EQ(r.status, 200) << "not served within 4 s";
  EXPECT_LT(seconds, 3.0);
  for (int fd : idle) close(fd);
}

}  // namespace
}  // namespace metrics
}  // namespace gtopk
