// Prometheus metrics: counters, gauges and histograms with labels, grouped in
// families and kept in a registry, in the shape of prometheus-cpp
// (github.com/jupp0r/prometheus-cpp, not packaged for Debian 12) so that it
// can be swapped in later:
//
//   gtopk::metrics::Registry registry;
//   auto& family = gtopk::metrics::BuildCounter()
//                      .Name("gtopk_worker_sent_bytes_total")
//                      .Help("Push bytes sent, per shard.")
//                      .Register(registry);
//   gtopk::metrics::Counter& sent = family.Add({{"shard", "0"}});
//   sent.Increment(1234);   // hot path: lock-free
//
// Output (GET /metrics) is the text exposition format 0.0.4
// (common/metrics/text_serializer.h), served by common/metrics/exposer.h.
//
// Thread-safety: every class here is thread-safe. Counter::Increment,
// Gauge::Set/Increment/Decrement and Histogram::Observe are lock-free (relaxed
// atomics; std::atomic<double> is lock-free on every supported target). Adding
// a new label set or registering a family takes a short per-family/registry
// lock; a scrape holds that lock only while it copies the list of series, so
// threads that increment existing series never wait for a scrape.
//
// Names are programmer input (constants in the code), so an invalid metric
// or label name, a reserved label name (`le` on a histogram, names starting
// with `__`), or a family registered twice with a different type or help is a
// programmer error: Register/Add abort with a message naming it (prometheus-
// cpp throws std::invalid_argument there). Label VALUES may be any string;
// they are escaped (and invalid UTF-8 is replaced) when serialized.
#ifndef GTOPK_COMMON_METRICS_METRICS_H_
#define GTOPK_COMMON_METRICS_METRICS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace gtopk {
namespace metrics {

// Label name -> value. Ordered, so a label set has one canonical form.
using Labels = std::map<std::string, std::string>;

enum class MetricType { kCounter, kGauge, kHistogram, kUntyped };

// "counter", "gauge", "histogram", "untyped" (the # TYPE spelling).
const char* MetricTypeName(MetricType type);

// Snapshot of one series (prometheus-cpp's ClientMetric).
struct ClientMetric {
  struct Label {
    std::string name;
    std::string value;
  };
  std::vector<Label> label;  // sorted by name, no duplicates
  // Counter, gauge, untyped.
  double value = 0;
  // Histogram: cumulative counts per upper bound (ascending, finite; the
  // implicit +Inf bucket is sample_count), the count and sum of samples.
  struct Bucket {
    uint64_t cumulative_count = 0;
    double upper_bound = 0;
  };
  std::vector<Bucket> bucket;
  uint64_t sample_count = 0;
  double sample_sum = 0;
};

// Snapshot of one family (prometheus-cpp's MetricFamily).
struct MetricFamily {
  std::string name;
  std::string help;
  MetricType type = MetricType::kUntyped;
  std::vector<ClientMetric> metric;
};

// Anything that contributes families to a scrape (prometheus-cpp's
// Collectable): the registry, a family, the process collector.
class Collectable {
 public:
  virtual ~Collectable() = default;
  // A consistent snapshot; must not block for long (runs on a scrape).
  virtual std::vector<MetricFamily> Collect() const = 0;
};

// [a-zA-Z_:][a-zA-Z0-9_:]*
bool IsValidMetricName(const std::string& name);
// [a-zA-Z_][a-zA-Z0-9_]* and not starting with "__" (reserved).
bool IsValidLabelName(const std::string& name);

// A monotonically increasing value (e.g. bytes sent). Lock-free.
class Counter {
 public:
  static constexpr MetricType kType = MetricType::kCounter;
  Counter() = default;
  // Adds `value`; negative and NaN values are ignored (a counter never
  // decreases).
  void Increment(double value = 1.0);
  double Value() const { return value_.load(std::memory_order_relaxed); }
  ClientMetric Collect() const;

 private:
  std::atomic<double> value_{0.0};
};

// A value that goes up and down (e.g. connected workers). Lock-free.
class Gauge {
 public:
  static constexpr MetricType kType = MetricType::kGauge;
  Gauge() = default;
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Increment(double value = 1.0);
  void Decrement(double value = 1.0) { Increment(-value); }
  // Seconds since the Unix epoch, now.
  void SetToCurrentTime();
  double Value() const { return value_.load(std::memory_order_relaxed); }
  ClientMetric Collect() const;

 private:
  std::atomic<double> value_{0.0};
};

// Upper bounds of histogram buckets: finite, strictly ascending. The +Inf
// bucket is implicit.
using BucketBoundaries = std::vector<double>;

// The duration buckets gtopk uses (docs/metrics.md): 100 us .. 60 s.
const BucketBoundaries& DurationBuckets();

// Samples counted into cumulative buckets (le = "less or equal"), plus their
// sum and count. Lock-free: one relaxed atomic add per bucket hit, one CAS
// loop for the sum. The count is derived from the bucket counts at collect
// time, so the le="+Inf" bucket always equals _count.
class Histogram {
 public:
  static constexpr MetricType kType = MetricType::kHistogram;
  // Precondition: `buckets` finite and strictly ascending (Family::Add checks).
  explicit Histogram(const BucketBoundaries& buckets);
  // Counts `value` into the first bucket with value <= bound (NaN and values
  // above the last bound: only the +Inf bucket) and adds it to the sum.
  void Observe(double value);
  ClientMetric Collect() const;

 private:
  const BucketBoundaries bounds_;
  // bounds_.size() + 1 non-cumulative counts (the last one: above all bounds).
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;
  std::atomic<double> sum_{0.0};
};

namespace internal {
// Aborts with "gtopk metrics: <message>" (programmer errors only).
[[noreturn]] void Fatal(const std::string& message);
// Checks label names (and reserved ones for the type); aborts on a bad one.
void CheckLabelNames(const Labels& labels, MetricType type,
                     const std::string& family);
void CheckBuckets(const BucketBoundaries& buckets, const std::string& family);
}  // namespace internal

// All series of one metric name, one per label set (prometheus-cpp's
// Family<T>). Owned by a Registry; references to it and to the metrics it
// returns stay valid as long as the registry lives.
template <typename T>
class Family final : public Collectable {
 public:
  Family(std::string name, std::string help, Labels constant_labels)
      : name_(std::move(name)),
        help_(std::move(help)),
        constant_labels_(std::move(constant_labels)) {
    internal::CheckLabelNames(constant_labels_, T::kType, name_);
  }

  // The series with these labels (constant labels are added), created on the
  // first call with `args` (Histogram: its BucketBoundaries); later calls
  // with the same labels return the same series (no duplicates). Aborts on an
  // invalid or reserved label name, or one that repeats a constant label.
  template <typename... Args>
  T& Add(const Labels& labels, Args&&... args) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : series_) {
      if (entry.first == labels) return *entry.second;
    }
    internal::CheckLabelNames(labels, T::kType, name_);
    for (const auto& [name, value] : labels) {
      if (constant_labels_.count(name) != 0) {
        internal::Fatal("label " + name + " of " + name_ +
                        " repeats a constant label");
      }
    }
    CheckArgs(args...);
    series_.emplace_back(labels,
                         std::make_shared<T>(std::forward<Args>(args)...));
    return *series_.back().second;
  }

  // True when a series with these labels exists.
  bool Has(const Labels& labels) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& entry : series_) {
      if (entry.first == labels) return true;
    }
    return false;
  }

  const std::string& GetName() const { return name_; }
  const std::string& GetHelp() const { return help_; }
  const Labels& GetConstantLabels() const { return constant_labels_; }

  // One family with every series (in creation order).
  std::vector<MetricFamily> Collect() const override {
    std::vector<std::pair<Labels, std::shared_ptr<T>>> snapshot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      snapshot = series_;  // copies pointers only: the lock is held briefly
    }
    MetricFamily family;
    family.name = name_;
    family.help = help_;
    family.type = T::kType;
    family.metric.reserve(snapshot.size());
    for (const auto& [labels, metric] : snapshot) {
      ClientMetric m = metric->Collect();
      Labels all = constant_labels_;
      all.insert(labels.begin(), labels.end());
      for (const auto& [name, value] : all) m.label.push_back({name, value});
      family.metric.push_back(std::move(m));
    }
    return {std::move(family)};
  }

 private:
  void CheckArgs() const {}
  void CheckArgs(const BucketBoundaries& buckets) const {
    internal::CheckBuckets(buckets, name_);
  }

  const std::string name_;
  const std::string help_;
  const Labels constant_labels_;
  mutable std::mutex mu_;
  std::vector<std::pair<Labels, std::shared_ptr<T>>> series_;
};

// Owns families; Collect returns them in registration order (each family's
// series contiguous). Thread-safe.
class Registry final : public Collectable {
 public:
  Registry() = default;
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  // The family `name`, created on the first call. A second registration
  // with the same name, type, help and constant labels returns the same
  // family (prometheus-cpp's InsertBehavior::Merge); with anything else it
  // aborts, as it does for an invalid name.
  template <typename T>
  Family<T>& Add(const std::string& name, const std::string& help,
                 const Labels& constant_labels) {
    if (!IsValidMetricName(name)) {
      internal::Fatal("invalid metric name '" + name + "'");
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const Entry& e : families_) {
      if (e.name != name) continue;
      auto* family = dynamic_cast<Family<T>*>(e.family.get());
      if (family == nullptr || family->GetHelp() != help ||
          family->GetConstantLabels() != constant_labels) {
        internal::Fatal("metric " + name +
                        " registered twice with a different type, help or "
                        "constant labels");
      }
      return *family;
    }
    auto family = std::make_shared<Family<T>>(name, help, constant_labels);
    Family<T>& ref = *family;
    families_.push_back({name, std::move(family)});
    return ref;
  }

  // Adds the families of `collectable` (held weakly; skipped once destroyed)
  // after the registry's own, e.g. values computed at scrape time. Their
  // names must not repeat the registry's (the serializer would merge them).
  void RegisterCollectable(const std::weak_ptr<Collectable>& collectable);

  std::vector<MetricFamily> Collect() const override;

 private:
  std::vector<std::weak_ptr<Collectable>> collectables_;
  struct Entry {
    std::string name;
    std::shared_ptr<Collectable> family;
  };
  mutable std::mutex mu_;
  std::vector<Entry> families_;
};

namespace detail {
// BuildCounter().Name(..).Help(..).Labels(..).Register(registry)
template <typename T>
class Builder {
 public:
  Builder& Name(const std::string& name) {
    name_ = name;
    return *this;
  }
  Builder& Help(const std::string& help) {
    help_ = help;
    return *this;
  }
  // Constant labels on every series of the family.
  Builder& Labels(const metrics::Labels& labels) {
    labels_ = labels;
    return *this;
  }
  Family<T>& Register(Registry& registry) const {
    return registry.Add<T>(name_, help_, labels_);
  }

 private:
  std::string name_;
  std::string help_;
  metrics::Labels labels_;
};
}  // namespace detail

inline detail::Builder<Counter> BuildCounter() { return {}; }
inline detail::Builder<Gauge> BuildGauge() { return {}; }
inline detail::Builder<Histogram> BuildHistogram() { return {}; }

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_METRICS_H_
