#include "common/metrics/process_collector.h"

#include <dirent.h>
#include <prometheus/client_metric.h>
#include <prometheus/gauge.h>
#include <prometheus/metric_type.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#ifndef GTOPK_VERSION
#define GTOPK_VERSION "unknown"
#endif
// 1 in builds with the CUDA kernels (CMake's GTOPK_HAVE_CUDA), for the
// build-info metric's "cuda" label.
#ifndef GTOPK_HAVE_CUDA
#define GTOPK_HAVE_CUDA 0
#endif

namespace gtopk {
namespace metrics {
namespace {

using prometheus::MetricFamily;
using prometheus::MetricType;

MetricFamily Single(const char* name, const char* help, MetricType type,
                    double value) {
  MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  prometheus::ClientMetric m;
  if (type == MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(m);
  return f;
}

bool ReadFile(const char* path, std::string* out) {
  std::ifstream in(path);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  *out = s.str();
  return true;
}

// CPU seconds and start time from /proc/self/stat (and the boot time from
// /proc/stat).
void CollectStat(std::vector<MetricFamily>* out) {
  const long ticks = sysconf(_SC_CLK_TCK);
  std::string stat;
  if (ticks <= 0 || !ReadFile("/proc/self/stat", &stat)) return;
  // Fields after the command name "(...)", which may contain spaces: the
  // state is field 3; utime 14, stime 15, starttime 22 (proc(5)).
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return;
  std::istringstream fields(stat.substr(close + 1));
  std::string field;
  unsigned long long utime = 0, stime = 0, start = 0;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return;
    if ((i == 14 && std::sscanf(field.c_str(), "%llu", &utime) != 1) ||
        (i == 15 && std::sscanf(field.c_str(), "%llu", &stime) != 1) ||
        (i == 22 && std::sscanf(field.c_str(), "%llu", &start) != 1)) {
      return;
    }
  }
  out->push_back(Single("process_cpu_seconds_total",
                        "Total user and system CPU time spent in seconds.",
                        MetricType::Counter,
                        static_cast<double>(utime + stime) / ticks));
  std::string proc_stat;
  if (!ReadFile("/proc/stat", &proc_stat)) return;
  const size_t at = proc_stat.find("\nbtime ");
  unsigned long long boot = 0;
  if (at == std::string::npos ||
      std::sscanf(proc_stat.c_str() + at + 7, "%llu", &boot) != 1) {
    return;
  }
  out->push_back(
      Single("process_start_time_seconds",
             "Start time of the process since unix epoch in seconds.",
             MetricType::Gauge,
             static_cast<double>(boot) + static_cast<double>(start) / ticks));
}

void CollectMemory(std::vector<MetricFamily>* out) {
  const long page = sysconf(_SC_PAGESIZE);
  std::string statm;
  unsigned long long size = 0, resident = 0;
  if (page <= 0 || !ReadFile("/proc/self/statm", &statm) ||
      std::sscanf(statm.c_str(), "%llu %llu", &size, &resident) != 2) {
    return;
  }
  out->push_back(Single("process_resident_memory_bytes",
                        "Resident memory size in bytes.", MetricType::Gauge,
                        static_cast<double>(resident) * page));
  out->push_back(Single("process_virtual_memory_bytes",
                        "Virtual memory size in bytes.", MetricType::Gauge,
                        static_cast<double>(size) * page));
}

void CollectFds(std::vector<MetricFamily>* out) {
  if (DIR* dir = opendir("/proc/self/fd")) {
    double open = 0;
    while (const dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ++open;
    }
    closedir(dir);
    // Not counting the descriptor opendir itself held while listing.
    out->push_back(Single("process_open_fds",
                          "Number of open file descriptors.", MetricType::Gauge,
                          open - 1));
  }
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 &&
      limit.rlim_cur != RLIM_INFINITY) {
    out->push_back(
        Single("process_max_fds", "Maximum number of open file descriptors.",
               MetricType::Gauge, static_cast<double>(limit.rlim_cur)));
  }
}

}  // namespace

std::vector<MetricFamily> ProcessCollector::Collect() const {
  std::vector<MetricFamily> out;
  CollectStat(&out);
  CollectMemory(&out);
  CollectFds(&out);
  return out;
}

void RegisterBuildInfo(prometheus::Registry& registry,
                       const std::string& program) {
  prometheus::BuildGauge()
      .Name("gtopk_build_info")
      .Help(
          "Always 1: the gtopk version, program and whether CUDA kernels "
          "were built.")
      .Register(registry)
      .Add({{"version", GTOPK_VERSION},
            {"program", program},
            {"cuda", GTOPK_HAVE_CUDA ? "true" : "false"}})
      .Set(1);
}

}  // namespace metrics
}  // namespace gtopk
