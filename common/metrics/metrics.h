// Prometheus metrics in gtopk: prometheus-cpp (Debian: prometheus-cpp-dev,
// github.com/jupp0r/prometheus-cpp) for counters, gauges, histograms,
// families, registries, the text format and the HTTP exposer; this folder
// keeps only what it lacks (process_collector.h: process_* and
// gtopk_build_info; exposer.h: starting an exposer without exceptions).
//
//   prometheus::Registry registry;
//   prometheus::Counter& sent = prometheus::BuildCounter()
//                                   .Name("gtopk_worker_sent_bytes_total")
//                                   .Help("Push bytes sent, per shard.")
//                                   .Register(registry)
//                                   .Add({{"shard", "0"}});
//   sent.Increment(1234);   // hot path: on the handle looked up once
//
// Thread-safety (prometheus-cpp 1.0.1): every class is thread-safe.
// Counter::Increment and Gauge::Set/Increment are lock-free (a CAS loop on
// std::atomic<double>); Histogram::Observe takes the histogram's own mutex
// (uncontended in gtopk: one thread observes a series at a time), so a scrape
// sees _count, _sum and the buckets of one consistent moment.
// Family::Add and BuildX().Register take the family's/registry's mutex:
// call them at start-up and keep the returned references, never per step.
// References stay valid as long as the registry lives.
//
// Names are programmer input (constants in the code): an invalid metric or
// label name, or one name registered with two types makes prometheus-cpp
// THROW std::invalid_argument. prometheus-cpp 1.0.1 does not reject a label
// named `le` on a histogram (it would be written twice): never use one. Label
// values may be any string; the serializer escapes backslash, double quote and
// newline, but writes other bytes as given, so label values must be valid UTF-8
// (all of gtopk's are ASCII constants). HELP text is written unescaped: it must
// hold no newline or backslash.
#ifndef GTOPK_COMMON_METRICS_METRICS_H_
#define GTOPK_COMMON_METRICS_METRICS_H_

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

namespace gtopk {
namespace metrics {

// The duration buckets gtopk uses (docs/metrics.md), in seconds: 100 us ..
// 60 s, ascending; +Inf is implicit. A value v counts into every bucket with
// bound >= v (le = "less or equal").
const prometheus::Histogram::BucketBoundaries& DurationBuckets();

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_METRICS_H_
