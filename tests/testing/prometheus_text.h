// Fetching and strictly parsing a Prometheus text-format (0.0.4) page.
#ifndef COLOD_TESTS_TESTING_PROMETHEUS_TEXT_H_
#define COLOD_TESTS_TESTING_PROMETHEUS_TEXT_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace colod::testing {

// GET http://HOST:PORT/path over a plain socket (HTTP/1.0). Returns the body;
// an HTTP status other than 200 is an error naming it.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path);

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct MetricFamily {
  std::string name;
  std::string type;  // counter, gauge, histogram, summary, untyped
  std::string help;
  std::vector<Sample> samples;
};

// Parses the text exposition format strictly: every line is a HELP or TYPE
// comment or a sample `name{l="v",...} value [timestamp]`; names and label
// names are valid identifiers; label values are quoted with \\ \" \n escapes;
// a sample belongs to the family declared before it (histogram/summary
// samples may add _bucket, _sum, _count); no family is declared twice.
// INVALID_ARGUMENT naming the line otherwise.
absl::StatusOr<std::map<std::string, MetricFamily>> ParsePrometheusText(const std::string& text);

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_PROMETHEUS_TEXT_H_
