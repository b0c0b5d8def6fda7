#include "common/metrics/metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace gtopk {
namespace metrics {
namespace {

static_assert(std::atomic<double>::is_always_lock_free,
              "metrics need lock-free atomic<double>");
static_assert(std::atomic<uint64_t>::is_always_lock_free,
              "metrics need lock-free atomic<uint64_t>");

void AtomicAdd(std::atomic<double>& target, double value) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + value,
                                       std::memory_order_relaxed)) {
  }
}

bool IsAlpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool IsDigit(char c) { return c >= '0' && c <= '9'; }

}  // namespace

const char* MetricTypeName(MetricType type) {
  switch (type) {
    case MetricType::kCounter: return "counter";
    case MetricType::kGauge: return "gauge";
    case MetricType::kHistogram: return "histogram";
    case MetricType::kUntyped: return "untyped";
  }
  return "untyped";
}

bool IsValidMetricName(const std::string& name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAlpha(c) || c == '_' || c == ':' || (i > 0 && IsDigit(c));
    if (!ok) return false;
  }
  return true;
}

bool IsValidLabelName(const std::string& name) {
  if (name.empty() || name.rfind("__", 0) == 0) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool ok = IsAlpha(c) || c == '_' || (i > 0 && IsDigit(c));
    if (!ok) return false;
  }
  return true;
}

void Counter::Increment(double value) {
  if (!(value >= 0)) return;  // negative or NaN
  AtomicAdd(value_, value);
}

ClientMetric Counter::Collect() const {
  ClientMetric m;
  m.value = Value();
  return m;
}

void Gauge::Increment(double value) { AtomicAdd(value_, value); }

void Gauge::SetToCurrentTime() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  Set(std::chrono::duration<double>(now).count());
}

ClientMetric Gauge::Collect() const {
  ClientMetric m;
  m.value = Value();
  return m;
}

const BucketBoundaries& DurationBuckets() {
  static const BucketBoundaries* const kBuckets = new BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
      0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
  return *kBuckets;
}

Histogram::Histogram(const BucketBoundaries& buckets)
    : bounds_(buckets),
      counts_(new std::atomic<uint64_t>[buckets.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) counts_[i].store(0);
}

void Histogram::Observe(double value) {
  // First bound >= value; NaN compares false everywhere and lands past the
  // end, i.e. only in +Inf.
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(bounds_.begin(), bounds_.end(), value) -
      bounds_.begin());
  counts_[std::isnan(value) ? bounds_.size() : bucket].fetch_add(
      1, std::memory_order_relaxed);
  AtomicAdd(sum_, value);
}

ClientMetric Histogram::Collect() const {
  ClientMetric m;
  uint64_t cumulative = 0;
  m.bucket.reserve(bounds_.size());
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cumulative += counts_[i].load(std::memory_order_relaxed);
    m.bucket.push_back({cumulative, bounds_[i]});
  }
  cumulative += counts_[bounds_.size()].load(std::memory_order_relaxed);
  m.sample_count = cumulative;  // == the +Inf bucket by construction
  m.sample_sum = sum_.load(std::memory_order_relaxed);
  return m;
}

namespace internal {

void Fatal(const std::string& message) {
  std::fprintf(stderr, "gtopk metrics: %s\n", message.c_str());
  std::abort();
}

void CheckLabelNames(const Labels& labels, MetricType type,
                     const std::string& family) {
  for (const auto& [name, value] : labels) {
    if (!IsValidLabelName(name)) {
      Fatal("invalid label name '" + name + "' on " + family);
    }
    if (type == MetricType::kHistogram && name == "le") {
      Fatal("label name 'le' is reserved on histogram " + family);
    }
  }
}

void CheckBuckets(const BucketBoundaries& buckets, const std::string& family) {
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (!std::isfinite(buckets[i]) || (i > 0 && !(buckets[i - 1] < buckets[i]))) {
      Fatal("bucket bounds of " + family +
            " must be finite and strictly ascending");
    }
  }
}

}  // namespace internal

void Registry::RegisterCollectable(
    const std::weak_ptr<Collectable>& collectable) {
  std::lock_guard<std::mutex> lock(mu_);
  collectables_.push_back(collectable);
}

std::vector<MetricFamily> Registry::Collect() const {
  std::vector<std::shared_ptr<Collectable>> families;
  {
    std::lock_guard<std::mutex> lock(mu_);
    families.reserve(families_.size());
    for (const Entry& e : families_) families.push_back(e.family);
    for (const auto& weak : collectables_) {
      if (auto c = weak.lock()) families.push_back(std::move(c));
    }
  }
  std::vector<MetricFamily> out;
  out.reserve(families.size());
  for (const auto& f : families) {
    for (MetricFamily& m : f->Collect()) out.push_back(std::move(m));
  }
  return out;
}

}  // namespace metrics
}  // namespace gtopk
