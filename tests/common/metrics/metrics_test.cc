// Tests of gtopk's metrics on prometheus-cpp: the exposition of a registry
// (escaping, special values, histograms) parsed back by a parser written
// here and checked by Prometheus's own (promtool check metrics); lock-free
// updates and consistent histogram snapshots under concurrency. The
// process_* collector and gtopk_build_info are tested in
// process_collector_test.cc, the HTTP exposer in exposer_test.cc (issue 44:
// tests mirror sources).
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

#include "gmock/gmock.h"
#include "gtest/gtest.h"
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
  const std::vector<Sample> s = ParseExposition(Serialize(*TrickyRegistry()));
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
      const std::vector<Sample> s = ParseExposition(Serialize(registry));
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
  const std::vector<Sample> s = ParseExposition(Serialize(registry));
  const double count = ValueOf(s, "h_seconds_count");
  EXPECT_EQ(count, double{kThreads} * kPerThread);
  // Values 0..4 equally often: <=1: 2/5, <=2: 3/5, <=3: 4/5.
  EXPECT_EQ(ValueOf(s, "h_seconds_bucket", {{"le", "1"}}), count * 2 / 5);
  EXPECT_EQ(ValueOf(s, "h_seconds_bucket", {{"le", "2"}}), count * 3 / 5);
  EXPECT_EQ(ValueOf(s, "h_seconds_bucket", {{"le", "3"}}), count * 4 / 5);
  EXPECT_EQ(ValueOf(s, "h_seconds_sum"), 2.0 * kThreads * kPerThread);
}

}  // namespace
}  // namespace metrics
}  // namespace gtopk
