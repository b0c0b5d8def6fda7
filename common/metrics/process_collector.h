// Metrics every gtopk process exports (docs/metrics.md, "Every process")
// that prometheus-cpp does not provide: the process_* metrics of
// Prometheus's client-library guidelines, read from /proc (Linux), and
// gtopk_build_info.
#ifndef GTOPK_COMMON_METRICS_PROCESS_COLLECTOR_H_
#define GTOPK_COMMON_METRICS_PROCESS_COLLECTOR_H_

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>
#include <prometheus/registry.h>

#include <string>
#include <vector>

namespace gtopk {
namespace metrics {

// A prometheus::Collectable that reads /proc/self/stat, /proc/self/statm,
// /proc/stat and /proc/self/fd plus getrlimit(RLIMIT_NOFILE) on every
// Collect (a scrape) and returns:
//   process_cpu_seconds_total      counter  user + system CPU, seconds
//   process_resident_memory_bytes  gauge    resident set size, bytes
//   process_virtual_memory_bytes   gauge    virtual memory size, bytes
//   process_start_time_seconds     gauge    start, seconds since the epoch
//   process_open_fds               gauge    open file descriptors
//   process_max_fds                gauge    the soft limit on them
// A source that cannot be read or parsed leaves its metrics out of that
// scrape (never an error). Register it with the exposer
// (prometheus::Exposer::RegisterCollectable, held weakly: keep the
// shared_ptr). Thread-safe (no state).
class ProcessCollector final : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

// Registers gtopk_build_info{version, program, cuda} = 1 in `registry`
// (version: the CMake project version; cuda: "true" when the CUDA kernels
// were built). `program` is e.g. "gtopk-server". Call once per registry, at
// start-up (a second call with the same program is a no-op).
void RegisterBuildInfo(prometheus::Registry& registry,
                       const std::string& program);

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_PROCESS_COLLECTOR_H_
