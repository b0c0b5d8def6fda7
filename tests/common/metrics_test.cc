// Tests of common/metrics: the text exposition format 0.0.4 against a
// hand-written golden file (escaping, special values, histograms), number
// formatting round trips, name validation, duplicate handling, lock-free
// updates under concurrency, the process collector and the HTTP exposer.
#include <httplib.h>

#include <atomic>
#include <clocale>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "common/metrics/exposer.h"
#include "common/metrics/metrics.h"
#include "common/metrics/process_collector.h"
#include "common/metrics/text_serializer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace gtopk {
namespace metrics {
namespace {

using ::testing::HasSubstr;

std::string ReadGolden(const std::string& name) {
  std::ifstream in(std::string(GTOPK_TESTDATA_DIR) + "/" + name);
  EXPECT_TRUE(in) << "cannot read golden file " << name;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(TextSerializerTest, MatchesGoldenFile) {
  const double inf = std::numeric_limits<double>::infinity();
  Registry registry;
  auto& requests = BuildCounter()
                       .Name("test_requests_total")
                       .Help("Requests \\ handled.\nSecond line with \"quotes\".")
                       .Register(registry);
  requests.Add({{"path", "/a\\b\"c\nd"}, {"code", "200"}}).Increment(3);
  requests.Add({{"path", "/"}, {"code", "500"}}).Increment(0.5);
  auto& values = BuildGauge()
                     .Name("test_values")
                     .Help("Special values.")
                     .Labels({{"unit", "x"}})
                     .Register(registry);
  values.Add({{"v", "pinf"}}).Set(inf);
  values.Add({{"v", "ninf"}}).Set(-inf);
  values.Add({{"v", "nan"}}).Set(std::nan(""));
  values.Add({{"v", "tenth"}}).Set(0.1);
  values.Add({{"v", "big"}}).Set(1e21);
  values.Add({{"v", "tiny"}}).Set(1.5e-7);
  values.Add({{"v", "neg"}}).Set(-2);
  values.Add({{"v", "int"}}).Set(42);
  values.Add({{"v", "utf8 \xC3\xA9 \xFF"}}).Set(1);  // invalid byte -> U+FFFD
  auto& latency = BuildHistogram()
                      .Name("test_latency_seconds")
                      .Help("Latency.")
                      .Register(registry);
  Histogram& push = latency.Add({{"phase", "push"}}, BucketBoundaries{0.125, 1, 10});
  latency.Add({{"phase", "wait"}}, BucketBoundaries{0.125, 1, 10});
  for (double v : {0.0625, 0.125, 0.5, 4.0, 100.0}) push.Observe(v);
  BuildCounter()
      .Name("test_unlabelled_total")
      .Help("A counter without labels.")
      .Register(registry)
      .Add({})
      .Increment(7);

  EXPECT_EQ(SerializeText(registry.Collect()),
            ReadGolden("metrics_golden.txt"));
}

TEST(TextSerializerTest, FormatNumberSpellsSpecialValues) {
  EXPECT_EQ(FormatNumber(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatNumber(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatNumber(std::nan("")), "NaN");
  EXPECT_EQ(FormatNumber(0), "0");
  EXPECT_EQ(FormatNumber(0.5), "0.5");
  // Go's strconv.FormatFloat(v, 'g', -1, 64), as client_golang writes them.
  EXPECT_EQ(FormatNumber(123456), "123456");
  EXPECT_EQ(FormatNumber(1234567), "1.234567e+06");
  EXPECT_EQ(FormatNumber(1e6), "1e+06");
  EXPECT_EQ(FormatNumber(0.0001), "0.0001");
  EXPECT_EQ(FormatNumber(0.00025), "0.00025");
  EXPECT_EQ(FormatNumber(0.00001), "1e-05");
  EXPECT_EQ(FormatNumber(-0.5), "-0.5");
  EXPECT_EQ(FormatNumber(100), "100");
  EXPECT_EQ(FormatNumber(12.5), "12.5");
  EXPECT_EQ(FormatNumber(4294967296.0), "4.294967296e+09");
}

// Every formatted double parses back (strtod, C locale) to the same bits,
// also while the process runs under a locale with a decimal comma.
TEST(TextSerializerTest, FormatNumberRoundTripsInAnyLocale) {
  const bool comma_locale =
      std::setlocale(LC_NUMERIC, "de_DE.UTF-8") != nullptr ||
      std::setlocale(LC_NUMERIC, "fr_FR.UTF-8") != nullptr;
  std::mt19937_64 rng(42);
  std::uniform_int_distribution<uint64_t> bits;
  std::vector<double> samples = {0.1, 1.0 / 3, 1e-300, 5e-324, 1.7976931348623157e308,
                                 -2.5, 123456789.125};
  for (int i = 0; i < 20000; ++i) {
    uint64_t b = bits(rng);
    double d;
    std::memcpy(&d, &b, sizeof d);
    if (std::isfinite(d)) samples.push_back(d);
  }
  for (double d : samples) {
    const std::string s = FormatNumber(d);
    EXPECT_EQ(s.find(','), std::string::npos) << s;
    std::setlocale(LC_NUMERIC, "C");
    const double back = std::strtod(s.c_str(), nullptr);
    if (comma_locale) std::setlocale(LC_NUMERIC, "de_DE.UTF-8");
    ASSERT_EQ(std::memcmp(&back, &d, sizeof d), 0) << s;
  }
  std::setlocale(LC_NUMERIC, "C");
}

TEST(TextSerializerTest, EscapesLabelValuesAndHelp) {
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
  EXPECT_EQ(EscapeHelp("a\\b\"c\nd"), "a\\\\b\"c\\nd");
  EXPECT_EQ(EscapeLabelValue("\xC3\xA9"), "\xC3\xA9");  // valid UTF-8 kept
  EXPECT_EQ(EscapeLabelValue("\xC3"), "\xEF\xBF\xBD");  // truncated sequence
  EXPECT_EQ(EscapeLabelValue("\xED\xA0\x80"),           // a surrogate
            "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

TEST(NamesTest, ValidatesMetricAndLabelNames) {
  for (const char* ok : {"a", "gtopk_worker_sent_bytes_total", "_x", "a:b", ":c",
                         "A9"}) {
    EXPECT_TRUE(IsValidMetricName(ok)) << ok;
  }
  for (const char* bad : {"", "9a", "a-b", "a b", "é", "a.b"}) {
    EXPECT_FALSE(IsValidMetricName(bad)) << bad;
  }
  for (const char* ok : {"shard", "_x", "le", "A_1"}) {
    EXPECT_TRUE(IsValidLabelName(ok)) << ok;
  }
  for (const char* bad : {"", "__name__", "__x", "1a", "a:b", "a-b"}) {
    EXPECT_FALSE(IsValidLabelName(bad)) << bad;
  }
}

TEST(NamesDeathTest, InvalidNamesAreProgrammerErrors) {
  Registry registry;
  EXPECT_DEATH(BuildCounter().Name("bad-name").Help("h").Register(registry),
               "invalid metric name 'bad-name'");
  auto& family = BuildCounter().Name("ok_total").Help("h").Register(registry);
  EXPECT_DEATH(family.Add({{"bad-label", "v"}}), "invalid label name");
  EXPECT_DEATH(family.Add({{"__reserved", "v"}}), "invalid label name");
  auto& hist = BuildHistogram().Name("h_seconds").Help("h").Register(registry);
  EXPECT_DEATH(hist.Add({{"le", "1"}}, BucketBoundaries{1}), "reserved");
  EXPECT_DEATH(hist.Add({}, BucketBoundaries{2, 1}), "strictly ascending");
  EXPECT_DEATH(BuildGauge().Name("ok_total").Help("h").Register(registry),
               "registered twice");
}

TEST(RegistryTest, NoDuplicateFamiliesOrSeries) {
  Registry registry;
  auto& a = BuildCounter().Name("x_total").Help("h").Register(registry);
  auto& b = BuildCounter().Name("x_total").Help("h").Register(registry);
  EXPECT_EQ(&a, &b);
  Counter& c1 = a.Add({{"k", "v"}});
  Counter& c2 = b.Add({{"k", "v"}});
  EXPECT_EQ(&c1, &c2);
  c1.Increment(2);
  c2.Increment(3);
  EXPECT_EQ(SerializeText(registry.Collect()),
            "# HELP x_total h\n# TYPE x_total counter\nx_total{k=\"v\"} 5\n");
}

// Families from different collectables with one name are merged into one
// contiguous block with one HELP/TYPE; duplicate series and a family of
// another type are dropped.
TEST(TextSerializerTest, MergesFamiliesAndDropsDuplicates) {
  auto series = [](const char* value, double v) {
    ClientMetric m;
    m.label.push_back({"k", value});
    m.value = v;
    return m;
  };
  MetricFamily first{"m_total", "first", MetricType::kCounter, {series("a", 1)}};
  MetricFamily other{"other", "o", MetricType::kGauge, {series("z", 9)}};
  MetricFamily second{"m_total", "second", MetricType::kCounter,
                      {series("b", 2), series("a", 3)}};
  MetricFamily wrong{"m_total", "gauge", MetricType::kGauge, {series("c", 4)}};
  MetricFamily invalid{"bad name", "x", MetricType::kGauge, {series("c", 4)}};
  EXPECT_EQ(SerializeText({first, other, second, wrong, invalid}),
            "# HELP m_total first\n# TYPE m_total counter\n"
            "m_total{k=\"a\"} 1\nm_total{k=\"b\"} 2\n"
            "# HELP other o\n# TYPE other gauge\nother{k=\"z\"} 9\n");
}

TEST(CounterTest, IgnoresNegativeAndNaN) {
  Counter c;
  c.Increment(2);
  c.Increment(-1);
  c.Increment(std::nan(""));
  EXPECT_EQ(c.Value(), 2);
}

// Increments from many threads are all counted (lock-free CAS, no lost
// updates), and every snapshot of a histogram taken meanwhile is
// consistent: cumulative buckets never decrease and +Inf equals _count.
TEST(ConcurrencyTest, NoLostUpdatesAndConsistentSnapshots) {
  Registry registry;
  Counter& counter =
      BuildCounter().Name("c_total").Help("h").Register(registry).Add({});
  Histogram& hist = BuildHistogram()
                        .Name("h_seconds")
                        .Help("h")
                        .Register(registry)
                        .Add({}, BucketBoundaries{1, 2, 3});
  constexpr int kThreads = 4, kPerThread = 50000;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    while (!done.load()) {
      const ClientMetric m = hist.Collect();
      uint64_t previous = 0;
      for (const auto& b : m.bucket) {
        ASSERT_GE(b.cumulative_count, previous);
        previous = b.cumulative_count;
      }
      ASSERT_GE(m.sample_count, previous);
      const std::string text = SerializeText(registry.Collect());
      const std::string inf = "h_seconds_bucket{le=\"+Inf\"} ";
      const std::string count = "h_seconds_count ";
      const size_t a = text.find(inf), b = text.find(count);
      ASSERT_NE(a, std::string::npos);
      ASSERT_NE(b, std::string::npos);
      ASSERT_EQ(std::stoull(text.substr(a + inf.size())),
                std::stoull(text.substr(b + count.size())));
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
  const ClientMetric m = hist.Collect();
  EXPECT_EQ(m.sample_count, uint64_t{kThreads} * kPerThread);
  // Values 0..4 equally often: <=1: 2/5, <=2: 3/5, <=3: 4/5.
  EXPECT_EQ(m.bucket[0].cumulative_count, m.sample_count * 2 / 5);
  EXPECT_EQ(m.bucket[1].cumulative_count, m.sample_count * 3 / 5);
  EXPECT_EQ(m.bucket[2].cumulative_count, m.sample_count * 4 / 5);
  EXPECT_EQ(m.sample_sum, 2.0 * kThreads * kPerThread);
}

// Resident memory against VmRSS from /proc/self/status (an independent
// reading); CPU time and start time against plain bounds.
TEST(ProcessCollectorTest, ReportsCpuMemoryAndStartTime) {
  std::vector<char> touch(64 << 20, 1);  // make RSS clearly non-trivial
  volatile char sink = touch[touch.size() / 2];
  (void)sink;
  std::ifstream status("/proc/self/status");
  std::string line;
  double vmrss = 0;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) vmrss = std::stod(line.substr(6)) * 1024;
  }
  ASSERT_GT(vmrss, 0);
  std::map<std::string, double> got;
  for (const MetricFamily& f : ProcessCollector().Collect()) {
    ASSERT_EQ(f.metric.size(), 1u) << f.name;
    got[f.name] = f.metric[0].value;
  }
  ASSERT_EQ(got.size(), 4u);
  EXPECT_NEAR(got["process_resident_memory_bytes"], vmrss, 8 << 20);
  EXPECT_GE(got["process_virtual_memory_bytes"], got["process_resident_memory_bytes"]);
  EXPECT_GE(got["process_cpu_seconds_total"], 0);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(got["process_start_time_seconds"], now + 1);
  EXPECT_GT(got["process_start_time_seconds"], now - 3600);
}

TEST(BuildInfoTest, IsOneWithVersionAndProgram) {
  Registry registry;
  RegisterBuildInfo(registry, "gtopk-test");
  const std::string text = SerializeText(registry.Collect());
  EXPECT_THAT(text, HasSubstr("# TYPE gtopk_build_info gauge\n"));
  EXPECT_THAT(text, HasSubstr("program=\"gtopk-test\""));
  EXPECT_THAT(text, HasSubstr("version=\"" GTOPK_PROJECT_VERSION "\"} 1\n"));
}

TEST(ExposerTest, ServesMetricsOverHttp) {
  auto registry = std::make_shared<Registry>();
  BuildCounter().Name("served_total").Help("h").Register(*registry).Add({}).Increment(4);
  absl::StatusOr<std::unique_ptr<Exposer>> exposer = Exposer::Start("127.0.0.1:0");
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  (*exposer)->RegisterCollectable(registry);
  ASSERT_GT((*exposer)->port(), 0);
  httplib::Client client("127.0.0.1", (*exposer)->port());
  auto response = client.Get("/metrics");
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->get_header_value("Content-Type"), kTextContentType);
  EXPECT_EQ(response->body,
            "# HELP served_total h\n# TYPE served_total counter\nserved_total 4\n");
  auto missing = client.Get("/other");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);

  // A second exposer on the same port fails with UNAVAILABLE.
  auto second = Exposer::Start("127.0.0.1:" + std::to_string((*exposer)->port()));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  // A collectable that went away is skipped.
  registry.reset();
  EXPECT_EQ((*exposer)->Scrape(), "");
}

// Scrapers that keep their connection open (Prometheus does; an HA pair is
// two of them) must not hold the exposer's two threads: a third scrape is
// answered at once, not after their keep-alive timeout (5 s by default).
TEST(ExposerTest, KeepAliveScrapersDoNotStarveOthers) {
  auto registry = std::make_shared<Registry>();
  BuildCounter()
      .Name("served_total")
      .Help("h")
      .Register(*registry)
      .Add({})
      .Increment(1);
  absl::StatusOr<std::unique_ptr<Exposer>> exposer =
      Exposer::Start("127.0.0.1:0");
  ASSERT_TRUE(exposer.ok()) << exposer.status();
  (*exposer)->RegisterCollectable(registry);
  const int port = (*exposer)->port();
  std::vector<std::unique_ptr<httplib::Client>> holders;
  for (int i = 0; i < 2; ++i) {
    holders.push_back(std::make_unique<httplib::Client>("127.0.0.1", port));
    holders.back()->set_keep_alive(true);
    auto held = holders.back()->Get("/metrics");
    ASSERT_TRUE(held);
    EXPECT_EQ(held->status, 200);
    // The exposer ends every connection after its response.
    EXPECT_EQ(held->get_header_value("Connection"), "close");
  }
  httplib::Client third("127.0.0.1", port);
  third.set_read_timeout(3, 0);  // below the 5 s keep-alive wait it replaced
  auto response = third.Get("/metrics");
  ASSERT_TRUE(response) << "the third scraper was not served within 3 s";
  EXPECT_EQ(response->status, 200);
}

TEST(ExposerTest, RejectsBadAddresses) {
  for (const char* bad : {"", "nohostport", "127.0.0.1:65536", "127.0.0.1:x", ":80"}) {
    EXPECT_EQ(Exposer::Start(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

}  // namespace
}  // namespace metrics
}  // namespace gtopk
