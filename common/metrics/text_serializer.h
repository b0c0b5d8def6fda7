// The Prometheus text exposition format 0.0.4
// (https://prometheus.io/docs/instrumenting/exposition_formats/), as served
// on GET /metrics with Content-Type kTextContentType.
#ifndef GTOPK_COMMON_METRICS_TEXT_SERIALIZER_H_
#define GTOPK_COMMON_METRICS_TEXT_SERIALIZER_H_

#include <string>
#include <vector>

#include "common/metrics/metrics.h"

namespace gtopk {
namespace metrics {

inline constexpr char kTextContentType[] =
    "text/plain; version=0.0.4; charset=utf-8";

// A sample value: "NaN", "+Inf", "-Inf", or the shortest decimal that parses
// back to the same double (std::to_chars: independent of the C locale, so
// never "0,5"), laid out as Go's strconv.FormatFloat(v, 'g', -1, 64) does
// (client_golang): "0.0001", "123456", "1e+06", "1.5e-07".
std::string FormatNumber(double value);

// Label value escaping: backslash -> \\, double quote -> \", newline -> \n;
// invalid UTF-8 bytes are replaced by U+FFFD (the format requires UTF-8).
std::string EscapeLabelValue(const std::string& value);
// HELP escaping: backslash -> \\, newline -> \n (quotes stay); invalid UTF-8
// replaced as above.
std::string EscapeHelp(const std::string& help);

// Serializes `families` in the text format:
//   # HELP name help
//   # TYPE name counter|gauge|histogram|untyped
//   name{label="value",...} value
// Histograms: name_bucket{...,le="bound"} cumulative count for every bound
// and le="+Inf" (== _count), then name_sum and name_count.
//
// Guarantees, whatever the input: one HELP/TYPE per name and every family's
// samples contiguous (families with the same name and type are merged into
// the first; a later family with the same name and another type is
// dropped), no duplicate series (a later series with the same label set is
// dropped), families and series with invalid metric/label names dropped.
// Thread-compatible (pure function).
std::string SerializeText(const std::vector<MetricFamily>& families);

}  // namespace metrics
}  // namespace gtopk

#endif  // GTOPK_COMMON_METRICS_TEXT_SERIALIZER_H_
