// The Prometheus text exposition in tests: serialise a collectable as the
// exposer serves it, parse the text back with a parser written from the
// format's specification (independent of prometheus-cpp), look samples up,
// and run promtool on it. Shared by the metrics tests of common/metrics/,
// server/ and worker/.
#ifndef GTOPK_TESTS_TESTING_EXPOSITION_H_
#define GTOPK_TESTS_TESTING_EXPOSITION_H_

#include <prometheus/collectable.h>
#include <prometheus/text_serializer.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace gtopk {
namespace testing {

// One sample line of the text format: name{labels} value.
struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// A parser of the text exposition format 0.0.4 written from the format's
// specification, independent of prometheus-cpp: label values unescaped
// (\\, \", \n), values through strtod (which, like Go's ParseFloat, takes
// NaN/Nan and +Inf/-Inf in any case). Fails the test on a malformed line.
inline std::vector<Sample> ParseExposition(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const size_t eq = line.find('=', i);
        EXPECT_NE(eq, std::string::npos) << line;
        if (eq == std::string::npos) return out;
        const std::string name = line.substr(i, eq - i);
        EXPECT_EQ(line[eq + 1], '"') << line;
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        s.labels[name] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;  // '}'
    }
    EXPECT_EQ(line[i], ' ') << line;
    s.value = std::strtod(line.c_str() + i + 1, nullptr);
    out.push_back(s);
  }
  return out;
}

// The value of the one sample `name`{`labels`}; NaN (and a test failure)
// when there is not exactly one.
inline double ValueOf(const std::vector<Sample>& samples,
                      const std::string& name,
                      const std::map<std::string, std::string>& labels = {}) {
  int found = 0;
  double value = std::nan("");
  for (const Sample& s : samples) {
    if (s.name == name && s.labels == labels) {
      ++found;
      value = s.value;
    }
  }
  EXPECT_EQ(found, 1) << name;
  return value;
}

inline std::string Serialize(const prometheus::Collectable& c) {
  return prometheus::TextSerializer().Serialize(c.Collect());
}

#ifdef GTOPK_PROMTOOL
// Runs `promtool check metrics` on `text` (GTOPK_PROMTOOL, defined by the
// test's target); returns its exit status and output (a fake status 127
// when promtool is missing).
inline int Promtool(const std::string& text, std::string* output) {
  char path[] = "/tmp/gtopk_exposition_XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return -1;
  EXPECT_EQ(write(fd, text.data(), text.size()),
            static_cast<ssize_t>(text.size()));
  close(fd);
  const std::string cmd =
      std::string("'") + GTOPK_PROMTOOL + "' check metrics < " + path + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  char buffer[512];
  while (p != nullptr && std::fgets(buffer, sizeof buffer, p) != nullptr) {
    *output += buffer;
  }
  const int status = p == nullptr ? -1 : pclose(p);
  std::remove(path);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#endif  // GTOPK_PROMTOOL

// Series line "name{labels} value" -> value, from the text format. Labels
// are written sorted by name (prometheus::Labels is a std::map).
inline std::map<std::string, double> ParseSeries(const std::string& text) {
  std::map<std::string, double> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.rfind(' ');
    out[line.substr(0, space)] = std::stod(line.substr(space + 1));
  }
  return out;
}

// The series `name` of `series`; a missing one fails the test and reads
// NaN, which no comparison accepts (operator[] would insert a 0 that
// passes EXPECT_EQ(..., 0)).
inline double SeriesValue(const std::map<std::string, double>& series,
                          const std::string& name) {
  const auto it = series.find(name);
  if (it == series.end()) {
    ADD_FAILURE() << name << " is not in the exposition";
    return std::numeric_limits<double>::quiet_NaN();
  }
  return it->second;
}

}  // namespace testing
}  // namespace gtopk

#endif  // GTOPK_TESTS_TESTING_EXPOSITION_H_
