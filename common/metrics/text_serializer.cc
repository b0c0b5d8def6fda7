#include "common/metrics/text_serializer.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <set>

namespace gtopk {
namespace metrics {
namespace {

// Length of the valid UTF-8 sequence at s[i], or 0 when it is invalid
// (overlong forms, surrogates and code points above U+10FFFF are invalid).
size_t Utf8SequenceLength(const std::string& s, size_t i) {
  const auto byte = [&s](size_t j) { return static_cast<unsigned char>(s[j]); };
  const unsigned char c = byte(i);
  if (c < 0x80) return 1;
  size_t len;
  uint32_t cp;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (size_t k = 1; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (byte(i + k) & 0x3F);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
      (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
    return 0;
  }
  return len;
}

std::string Escape(const std::string& in, bool quote) {
  std::string out;
  out.reserve(in.size());
  for (size_t i = 0; i < in.size();) {
    const char c = in[i];
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (quote && c == '"') {
      out += "\\\"";
    } else {
      const size_t len = Utf8SequenceLength(in, i);
      if (len == 0) {
        out += "\xEF\xBF\xBD";  // U+FFFD
        ++i;
        continue;
      }
      out.append(in, i, len);
      i += len;
      continue;
    }
    ++i;
  }
  return out;
}

void WriteLabels(const std::vector<ClientMetric::Label>& labels,
                 const char* extra_name, const std::string& extra_value,
                 std::string* out) {
  if (labels.empty() && extra_name == nullptr) return;
  *out += '{';
  bool first = true;
  for (const ClientMetric::Label& l : labels) {
    if (!first) *out += ',';
    first = false;
    *out += l.name;
    *out += "=\"";
    *out += EscapeLabelValue(l.value);
    *out += '"';
  }
  if (extra_name != nullptr) {
    if (!first) *out += ',';
    *out += extra_name;
    *out += "=\"";
    *out += extra_value;
    *out += '"';
  }
  *out += '}';
}

void WriteSample(const std::string& name, const char* suffix,
                 const ClientMetric& m, const char* extra_name,
                 const std::string& extra_value, const std::string& value,
                 std::string* out) {
  *out += name;
  *out += suffix;
  WriteLabels(m.label, extra_name, extra_value, out);
  *out += ' ';
  *out += value;
  *out += '\n';
}

bool LabelsValid(const ClientMetric& m, MetricType type) {
  std::set<std::string> seen;
  for (const ClientMetric::Label& l : m.label) {
    if (!IsValidLabelName(l.name) || !seen.insert(l.name).second) return false;
    if (type == MetricType::kHistogram && l.name == "le") return false;
  }
  return true;
}

}  // namespace

std::string FormatNumber(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  // Shortest round-trip digits, as "d.ddde+XX" (C locale by definition).
  char buffer[64];
  const std::to_chars_result r = std::to_chars(
      buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  const std::string sci(buffer, r.ptr);
  const size_t e = sci.find('e');
  const int exponent = std::atoi(sci.c_str() + e + 1);
  // Go's strconv.FormatFloat(v, 'g', -1, 64), which the reference client
  // (client_golang) uses: the exponent form when exp < -4 or exp >= 6 (so
  // 1e+06, 123456, 0.0001, 1e-05). Matching it keeps `le` label strings
  // identical to other clients' (le="0.0001").
  if (exponent < -4 || exponent >= 6) return sci;
  const bool negative = sci[0] == '-';
  std::string digits;
  for (size_t i = negative ? 1 : 0; i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  std::string out = negative ? "-" : "";
  if (exponent < 0) {
    out += "0.";
    out.append(static_cast<size_t>(-exponent - 1), '0');
    out += digits;
    return out;
  }
  const size_t integer_digits = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= integer_digits) {
    out += digits;
    out.append(integer_digits - digits.size(), '0');
  } else {
    out += digits.substr(0, integer_digits);
    out += '.';
    out += digits.substr(integer_digits);
  }
  return out;
}

std::string EscapeLabelValue(const std::string& value) {
  return Escape(value, /*quote=*/true);
}

std::string EscapeHelp(const std::string& help) {
  return Escape(help, /*quote=*/false);
}

std::string SerializeText(const std::vector<MetricFamily>& families) {
  // Merge by name, keeping the first family's position, help and type.
  std::vector<MetricFamily> merged;
  std::map<std::string, size_t> index;
  for (const MetricFamily& f : families) {
    if (!IsValidMetricName(f.name)) continue;
    auto it = index.find(f.name);
    if (it == index.end()) {
      index.emplace(f.name, merged.size());
      merged.push_back(f);
      continue;
    }
    MetricFamily& into = merged[it->second];
    if (into.type != f.type) continue;
    into.metric.insert(into.metric.end(), f.metric.begin(), f.metric.end());
  }

  std::string out;
  for (const MetricFamily& f : merged) {
    out += "# HELP ";
    out += f.name;
    out += ' ';
    out += EscapeHelp(f.help);
    out += "\n# TYPE ";
    out += f.name;
    out += ' ';
    out += MetricTypeName(f.type);
    out += '\n';
    std::set<std::vector<std::pair<std::string, std::string>>> seen;
    for (const ClientMetric& m : f.metric) {
      if (!LabelsValid(m, f.type)) continue;
      std::vector<std::pair<std::string, std::string>> key;
      for (const ClientMetric::Label& l : m.label) key.emplace_back(l.name, l.value);
      std::sort(key.begin(), key.end());
      if (!seen.insert(key).second) continue;
      // Canonical label order (sorted by name).
      ClientMetric sorted = m;
      std::sort(sorted.label.begin(), sorted.label.end(),
                [](const ClientMetric::Label& a, const ClientMetric::Label& b) {
                  return a.name < b.name;
                });
      if (f.type != MetricType::kHistogram) {
        WriteSample(f.name, "", sorted, nullptr, "", FormatNumber(m.value),
                    &out);
        continue;
      }
      for (const ClientMetric::Bucket& b : m.bucket) {
        WriteSample(f.name, "_bucket", sorted, "le",
                    FormatNumber(b.upper_bound),
                    std::to_string(b.cumulative_count), &out);
      }
      WriteSample(f.name, "_bucket", sorted, "le", "+Inf",
                  std::to_string(m.sample_count), &out);
      WriteSample(f.name, "_sum", sorted, nullptr, "",
                  FormatNumber(m.sample_sum), &out);
      WriteSample(f.name, "_count", sorted, nullptr, "",
                  std::to_string(m.sample_count), &out);
    }
  }
  return out;
}

}  // namespace metrics
}  // namespace gtopk
