// Tests of gtopk's metrics on prometheus-cpp: the exposition of a registry
// (escaping, special values, histograms) parsed back by a parser written
// here and checked by Prometheus's own (promtool check metrics); lock-free
// updates and consistent histogram snapshots under concurrency; the
// process_* collector against independent readings; gtopk_build_info; and
// the HTTP exposer (GET /metrics over a raw socket, keep-alive and idle
// connections that must not starve other scrapers, bind errors as Status).
#include "common/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <prometheus/text_serializer.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics/exposer.h"
#include "common/metrics/process_collector.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// One sample line of the text format: name{labels} value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// A parser of the text exposition format 0.0.4 written from the format's
// specification, independent of prometheus-cpp: label values unescaped
// (\\, \", \n), values through strtod (which, like Go's ParseFloat, takes
// NaN/Nan and +Inf/-Inf in any case). Fails the test on a malformed line.
std::vector<Sample> Parse(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        EXPECT_NE(eq, std::string::npos) << line;
        if (eq == std::string::npos) return out;
        const std::string name = line.substr(i, eq - i);
        EXPECT_EQ(line[eq + 1], '"') << line;
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        s.labels[name] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;  // '}'
    }
    EXPECT_EQ(line[i], ' ') << line;
    s.value = std::strtod(line.c_str() + i + 1, nullptr);
    out.push_back(s);
  }
  return out;
}

// The value of the one sample `name`{`labels`}; NaN (and a test failure)
// when there is not exactly one.
double ValueOf(const std::vector<Sample>& samples, const std::string& name,
               const std::map<std::string, std::string>& labels = {}) {
  int found = 0;
  double value = std::nan("");
  for (const Sample& s : samples) {
    if (s.name == name && s.labels == labels) {
      ++found;
      value = s.value;
    }
  }
  EXPECT_EQ(found, 1) << name;
  return value;
}

std::string Serialize(const prometheus::Collectable& c) {
  return prometheus::TextSerializer().Serialize(c.Collect());
}

// Runs `promtool check metrics` on `text`; returns its exit status and
// output (a fake status 127 when promtool is missing).
int Promtool(const std::string& text, std::string* output) {
  char path[] = "/tmp/gtopk_metrics_test_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return -1;
  EXPECT_EQ(write(fd, text.data(), text.size()),
            static_cast<ssize_t>(text.size()));
  close(fd);
  const std::string cmd =
      std::string("'") + GTOPK_PROMTOOL + "' check metrics < " + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  char buffer[512];
  while (p != nullptr && std::fgets(buffer, sizeof buffer, p) != nullptr) {
    *output += buffer;
  }
  const int status = p == nullptr ? -1 : pclose(p);
  std::remove(path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A registry with what the format makes hard: label values with backslash,
// quote and newline, special values, histograms with several series.
std::shared_ptr<prometheus::Registry> TrickyRegistry() {
  const double inf = std::numeric_limits<double>::infinity();
  auto registry = std::make_shared<prometheus::Registry>();
  auto& requests = prometheus::BuildCounter()
                       .Name("test_requests_total")
                       .Help("Requests handled, with \"quotes\".")
                       .Register(*registry);
  requests.Add({{"path", "/a\\b\"c\nd"}, {"code", "200"}}).Increment(3);
  requests.Add({{"path", "/"}, {"code", "500"}}).Increment(0.5);
  auto& values = prometheus::BuildGauge()
                     .Name("test_values")
                     .Help("Special values.")
                     .Labels({{"unit", "x"}})
                     .Register(*registry);
  values.Add({{"v", "pinf"}}).Set(inf);
  values.Add({{"v", "ninf"}}).Set(-inf);
  values.Add({{"v", "nan"}}).Set(std::nan(""));
  values.Add({{"v", "tenth"}}).Set(0.1);
  values.Add({{"v", "big"}}).Set(1e21);
  values.Add({{"v", "tiny"}}).Set(1.5e-7);
  values.Add({{"v", "neg"}}).Set(-2);
  values.Add({{"v", "utf8 \xC3\xA9"}}).Set(42);
  auto& latency = prometheus::BuildHistogram()
                      .Name("test_latency_seconds")
                      .Help("Latency.")
                      .Register(*registry);
  auto& push =
      latency.Add({{"phase", "push"}},
                  prometheus::Histogram::BucketBoundaries{0.125, 1, 10});
  latency.Add({{"phase", "wait"}}, DurationBuckets());
  for (double v : {0.0625, 0.125, 0.5, 4.0, 100.0}) push.Observe(v);
  prometheus::BuildCounter()
      .Name("test_unlabelled_total")
      .Help("A counter without labels.")
      .Register(*registry)
      .Add({})
      .Increment(7);
  return registry;
}

TEST(ExpositionTest, ParsesBackToWhatWasRecorded) {
  const std::vector<Sample> s = Parse(Serialize(*TrickyRegistry()));
  EXPECT_EQ(ValueOf(s, "test_requests_total",
                    {{"path", "/a\\b\"c\nd"}, {"code", "200"}}),
            3);
  EXPECT_EQ(ValueOf(s, "test_requests_total", {{"path", "/"}, {"code", "500"}}),
            0.5);
  const auto v = [&s](const char* which) {
    return ValueOf(s, "test_values", {{"unit", "x"}, {"v", which}});
  };
  EXPECT_EQ(v("pinf"), std::numeric_limits<double>::infinity());
  EXPECT_EQ(v("ninf"), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(v("nan")));
  EXPECT_EQ(v("tenth"), 0.1);
  EXPECT_EQ(v("big"), 1e21);
  EXPECT_EQ(v("tiny"), 1.5e-7);
  EXPECT_EQ(v("neg"), -2);
  EXPECT_EQ(v("utf8 \xC3\xA9"), 42);
  // Cumulative buckets: 0.0625 and 0.125 (a value on a bound counts there)
  // <= 0.125; 0.5 <= 1; 4 <= 10; 100 only in +Inf.
  const auto bucket = [&s](const char* le) {
    return ValueOf(s, "test_latency_seconds_bucket",
                   {{"phase", "push"}, {"le", le}});
  };
  EXPECT_EQ(bucket("0.125"), 2);
  EXPECT_EQ(bucket("1"), 3);
  EXPECT_EQ(bucket("10"), 4);
  EXPECT_EQ(bucket("+Inf"), 5);
  EXPECT_EQ(ValueOf(s, "test_latency_seconds_count", {{"phase", "push"}}), 5);
  EXPECT_EQ(ValueOf(s, "test_latency_seconds_sum", {{"phase", "push"}}),
            104.6875);
  EXPECT_EQ(ValueOf(s, "test_unlabelled_total"), 7);
  // The duration buckets' `le` strings are the ones docs/metrics.md lists
  // and dashboards may name (as client_golang writes them).
  for (const char* le : {"0.0001", "0.00025", "0.0005", "0.001", "0.0025",
                         "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5",
                         "1", "2.5", "5", "10", "30", "60", "+Inf"}) {
    EXPECT_EQ(ValueOf(s, "test_latency_seconds_bucket",
                      {{"phase", "wait"}, {"le", le}}),
              0)
        << le;
  }
}

TEST(ExpositionTest, PassesPromtool) {
  std::string output;
  const int status = Promtool(Serialize(*TrickyRegistry()), &output);
  ASSERT_NE(status, 127) << "promtool not found: apt-get install prometheus "
                            "(make deps)";
  EXPECT_EQ(status, 0) << output;
}

// Names are programmer input; prometheus-cpp throws on a bad one (what
// common/metrics/metrics.h tells callers to expect).
TEST(NamesTest, InvalidNamesThrow) {
  prometheus::Registry registry;
  EXPECT_THROW(
      prometheus::BuildCounter().Name("bad-name").Help("h").Register(registry),
      std::invalid_argument);
  EXPECT_THROW(prometheus::BuildCounter()
                   .Name("x_total")
                   .Help("h")
                   .Register(registry)
                   .Add({{"bad-label", "v"}}),
               std::invalid_argument);
  prometheus::BuildCounter().Name("ok_total").Help("h").Register(registry);
  EXPECT_THROW(
      prometheus::BuildGauge().Name("ok_total").Help("h").Register(registry),
      std::invalid_argument);
}

// Increments from many threads are all counted (no lost updates), and every
// snapshot of a histogram taken meanwhile is consistent: cumulative buckets
// never decrease and +Inf equals _count.
TEST(ConcurrencyTest, NoLostUpdatesAndConsistentSnapshots) {
  prometheus::Registry registry;
  prometheus::Counter& counter = prometheus::BuildCounter()
                                     .Name("c_total")
                                     .Help("h")
                                     .Register(registry)
                                     .Add({});
  prometheus::Histogram& hist =
      prometheus::BuildHistogram()
          .Name("h_seconds")
          .Help("h")
          .Register(registry)
          .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 3});
  constexpr int kThreads = 4, kPerThread = 50000;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) {
      const std::vector<Sample> s = Parse(Serialize(registry));
      double previous = 0;
      for (const char* le : {"1", "2", "3", "+Inf"}) {
        const double b = ValueOf(s, "h_seconds_bucket", {{"le", le}});
        ASSERT_GE(b, previous);
        previous = b;
      }
      ASSERT_EQ(previous, ValueOf(s, "h_seconds_count"));
    }
  });
  std::vector<std::thread> writers;
  for (int t = 0; t < kThreads; ++t) {
    writers.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        counter.Increment(1);
        hist.Observe((i + t) % 5);  // 0,1,2,3,4
      }
    });
  }
  for (auto& w : writers) w.join();
  done = true;
  reader.join();
  EXPECT_EQ(counter.Value(), double{kThreads} * kPerThread);
  const std::vector<Sample> s = Parse(Serialize(registry));
  const double count = ValueOf(s, "h_seconds_count");
  EXPECT_EQ(count, double{kThreads} * kPerThread);
  // Values 0..4 equally often: <=1: 2/5, <=2: 3/5, <=3: 4/5.
  EXPECT_EQ(ValueOf(s, "h_seconds_bucket", {{"le", "1"}}), count * 2 / 5);
  EXPECT_EQ(ValueOf(s, "h_seconds_bucket", {{"le", "2"}}), count * 3 / 5);
  EXPECT_EQ(ValueOf(s, "h_seconds_bucket", {{"le", "3"}}), count * 4 / 5);
  EXPECT_EQ(ValueOf(s, "h_seconds_sum"), 2.0 * kThreads * kPerThread);
}

// The value of `key` ("VmRSS:", "Max open files") in a /proc text file: the
// first number after it.
double ProcField(const char* path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stod(line.substr(key.size()));
  }
  ADD_FAILURE() << key << " not in " << path;
  return 0;
}

// The sample `name` of `got`; a missing one fails the test and reads NaN,
// which no comparison accepts (operator[] would insert a 0 that passes
// EXPECT_GE(..., 0)).
double Value(const std::map<std::string, double>& got,
             const std::string& name) {
  const auto it = got.find(name);
  if (it == got.end()) {
    ADD_FAILURE() << name << " is not in the exposition";
    return std::numeric_limits<double>::quiet_NaN();
  }
  return it->second;
}

// Each process_* value against an independent reading: VmRSS and VmSize
// from /proc/self/status, "Max open files" from /proc/self/limits, the fd
// count moved by opening descriptors; CPU and start time against bounds.
TEST(ProcessCollectorTest, ReportsTheStandardProcessMetrics) {
  std::vector<char> touch(64 << 20, 1);  // make RSS clearly non-trivial
  volatile char sink = touch[touch.size() / 2];
  (void)sink;
  auto collector = std::make_shared<ProcessCollector>();
  const auto collect = [&collector] {
    std::map<std::string, double> got;
    for (const Sample& s : Parse(Serialize(*collector))) got[s.name] = s.value;
    return got;
  };
  std::map<std::string, double> got = collect();
  EXPECT_EQ(got.size(), 6u);
  const double vmrss = ProcField("/proc/self/status", "VmRSS:") * 1024;
  const double vmsize = ProcField("/proc/self/status", "VmSize:") * 1024;
  EXPECT_NEAR(Value(got, "process_resident_memory_bytes"), vmrss, 8 << 20);
  EXPECT_NEAR(Value(got, "process_virtual_memory_bytes"), vmsize, 64 << 20);
  EXPECT_GE(Value(got, "process_cpu_seconds_total"), 0);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(Value(got, "process_start_time_seconds"), now + 1);
  EXPECT_GT(Value(got, "process_start_time_seconds"), now - 3600);
  EXPECT_EQ(Value(got, "process_max_fds"),
            ProcField("/proc/self/limits", "Max open files"));
  const double open_before = Value(got, "process_open_fds");
  EXPECT_GE(open_before, 3);  // stdin, stdout, stderr at least
  std::vector<int> fds;
  for (int i = 0; i < 10; ++i) fds.push_back(dup(1));
  EXPECT_EQ(Value(collect(), "process_open_fds"), open_before + 10);
  for (int fd : fds) close(fd);
  EXPECT_EQ(Value(collect(), "process_open_fds"), open_before);
  // Types and help as docs/metrics.md (and Prometheus's guidelines) have
  // them, and promtool accepts the result.
  const std::string text = Serialize(*collector);
  EXPECT_THAT(text, HasSubstr("# TYPE process_cpu_seconds_total counter\n"));
  EXPECT_THAT(text, HasSubstr("# TYPE process_open_fds gauge\n"));
  std::string output;
  EXPECT_EQ(Promtool(text, &output), 0) << output;
}

TEST(BuildInfoTest, IsOneWithVersionProgramAndCuda) {
  prometheus::Registry registry;
  RegisterBuildInfo(registry, "gtopk-test");
  RegisterBuildInfo(registry, "gtopk-test");  // no duplicate series
  const std::string text = Serialize(registry);
  EXPECT_THAT(text, HasSubstr("# TYPE gtopk_build_info gauge\n"));
  const std::vector<Sample> s = Parse(text);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].name, "gtopk_build_info");
  EXPECT_EQ(s[0].value, 1);
  EXPECT_EQ(s[0].labels.at("program"), "gtopk-test");
  EXPECT_EQ(s[0].labels.at("version"), GTOPK_PROJECT_VERSION);
  EXPECT_THAT(s[0].labels.at("cuda"), ::testing::AnyOf("true", "false"));
}

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
  EXPECT_EQ(ValueOf(Parse(response.body), "served_total", {{"k", "a\"b"}}), 4);
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
