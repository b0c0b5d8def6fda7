// Metrics every gtopk process exports (docs/metrics.md, "Every process"):
// CPU seconds, resident and virtual memory and start time from /proc/self
// (Linux), under the names Prometheus's client-library guidelines define
// (process_*), and gtopk_build_info.
#ifndef GTOPK_COMMON_METRICS_PROCESS_COLLECTOR_H_
#define GTOPK_COMMON_METRICS_PROCESS_COLLECTOR_H_

#include <string>
#include <vector>

#include "common/metrics/metrics.h"

namespace gtopk {
namespace metrics {

// Reads /proc/self/stat, /proc/self/statm and /proc/stat on every Collect
// (a scrape): process_cpu_seconds_total (user + system), process_resident_
// memory_bytes, process_virtual_memory_bytes, process_start_time_seconds.
// A file that cannot be read or parsed leaves its metrics out of that
// scrape (never an error). Thread-safe.
class ProcessCollector final : public Collectable {
 public:
  std::vector<MetricFamily> Collect() const override;
};

// Registers gtopk_build_info{version, program, cuda} = 1 in `registry`
// (version: the CMake project version; cuda: "true" when the CUDA kernels
// were built). `program` is e.g. "gtopk-server".
void RegisterBuildInfo(Registry& registry, const std::string& program);

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_PROCESS_COLLECTOR_H_
