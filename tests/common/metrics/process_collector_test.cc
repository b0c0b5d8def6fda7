// The process_* collector against independent readings (/proc/self), and
// gtopk_build_info (common/metrics/process_collector.h). Moved from
// tests/common/metrics_test.cc (issue 44: tests mirror sources).
#include "common/metrics/process_collector.h"

#include <unistd.h>

#include <ctime>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "tests/testing/exposition.h"

namespace gtopk {
namespace metrics {
namespace {

using ::gtopk::testing::ParseExposition;
using ::gtopk::testing::Promtool;
using ::gtopk::testing::Sample;
using ::gtopk::testing::Serialize;
using ::gtopk::testing::SeriesValue;
using ::gtopk::testing::ValueOf;
using ::testing::HasSubstr;

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
    for (const Sample& s : ParseExposition(Serialize(*collector)))
      got[s.name] = s.value;
    return got;
  };
  std::map<std::string, double> got = collect();
  EXPECT_EQ(got.size(), 6u);
  const double vmrss = ProcField("/proc/self/status", "VmRSS:") * 1024;
  const double vmsize = ProcField("/proc/self/status", "VmSize:") * 1024;
  EXPECT_NEAR(SeriesValue(got, "process_resident_memory_bytes"), vmrss,
              8 << 20);
  EXPECT_NEAR(SeriesValue(got, "process_virtual_memory_bytes"), vmsize,
              64 << 20);
  EXPECT_GE(SeriesValue(got, "process_cpu_seconds_total"), 0);
  const double now = static_cast<double>(std::time(nullptr));
  EXPECT_LE(SeriesValue(got, "process_start_time_seconds"), now + 1);
  EXPECT_GT(SeriesValue(got, "process_start_time_seconds"), now - 3600);
  EXPECT_EQ(SeriesValue(got, "process_max_fds"),
            ProcField("/proc/self/limits", "Max open files"));
  const double open_before = SeriesValue(got, "process_open_fds");
  EXPECT_GE(open_before, 3);  // stdin, stdout, stderr at least
  std::vector<int> fds;
  for (int i = 0; i < 10; ++i) fds.push_back(dup(1));
  EXPECT_EQ(SeriesValue(collect(), "process_open_fds"), open_before + 10);
  for (int fd : fds) close(fd);
  EXPECT_EQ(SeriesValue(collect(), "process_open_fds"), open_before);
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
  const std::vector<Sample> s = ParseExposition(text);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].name, "gtopk_build_info");
  EXPECT_EQ(s[0].value, 1);
  EXPECT_EQ(s[0].labels.at("program"), "gtopk-test");
  EXPECT_EQ(s[0].labels.at("version"), GTOPK_PROJECT_VERSION);
  EXPECT_THAT(s[0].labels.at("cuda"), ::testing::AnyOf("true", "false"));
}

}  // namespace
}  // namespace metrics
}  // namespace gtopk
