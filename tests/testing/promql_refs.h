// What a PromQL expression reads: the metrics it names and the labels it
// relies on them to carry. For tests that hold the Prometheus rules and the
// Grafana dashboard in deploy/ against the series the daemons export.
#ifndef COLOD_TESTS_TESTING_PROMQL_REFS_H_
#define COLOD_TESTS_TESTING_PROMQL_REFS_H_

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace colod::testing {

// The labels the series of a metric (or recording rule) name carry;
// nullopt for a name that is not exported.
using LabelLookup = std::function<std::optional<std::set<std::string>>(const std::string& name)>;

struct PromqlRefs {
  // Every metric or recording-rule name the expression selects.
  std::set<std::string> names;
  // The labels of its result: the union of the labels of the series it
  // combines (an upper bound where a one-to-one match keeps fewer).
  std::set<std::string> output_labels;
  // What does not fit, one line each: a name `labels_of` does not know, a
  // label a name lacks (in a matcher, in by/without of an aggregation over
  // it, in on/ignoring of a binary operation on it, in group_left/right when
  // no operand has it), or an expression this reader cannot follow.
  std::vector<std::string> problems;
};

// Reads `expr` with a tokenizer and a light parser (not a full PromQL
// parser: operator precedence is ignored, which the checks above do not
// need). Scopes follow the expression: the labels in `by` must be on every
// series aggregated; an inner aggregation yields only its `by` labels, so an
// outer one cannot use labels it aggregated away; histogram_quantile drops
// `le`; on/ignoring apply to the operands within the same parentheses.
PromqlRefs ReadPromql(absl::string_view expr, const LabelLookup& labels_of);

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_PROMQL_REFS_H_
