#!/bin/bash
# Every query of deploy/grafana/colod.json is valid PromQL: each is checked
# by promtool as a recording rule, with Grafana's variables replaced
# ($__rate_interval and $__range by durations, $job_id by a regex). That each
# names only metrics and labels colod exports is //tests:dashboard_metrics_test.
set -euo pipefail

# fail(), $tmp, $promtool, and the working directory: deploy/prometheus/test_env.sh
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "${TEST_SRCDIR}/${TEST_WORKSPACE}/deploy/prometheus/test_env.sh" deploy/grafana
else
  cd "$(dirname "${BASH_SOURCE[0]}")"
  source ../prometheus/test_env.sh deploy/grafana
fi

# "expr": "..." and "query": "..." strings (colod.json has one per line),
# JSON-unescaped; label_values(...) is Grafana's, not PromQL.
exprs="$(sed -n 's/^ *"expr": "\(.*\)",\{0,1\}$/\1/p' colod.json | sed 's/\\"/"/g; s/\\\\/\\/g')"
count="$(grep -c '"expr":' colod.json)"
[[ "$count" -gt 0 ]] || fail "no expr in colod.json"
[[ "$(wc -l <<< "$exprs")" == "$count" ]] || fail "could not read every expr of colod.json"
{
  echo "groups:"
  echo "  - name: dashboard"
  echo "    rules:"
  i=0
  while IFS= read -r e; do
    i=$((i + 1))
    e="${e//\$__rate_interval/1m}"
    e="${e//\$__range/1h}"
    e="${e//\$job_id/.*}"
    [[ "$e" != *'$'* ]] || fail "an unknown Grafana variable in: $e"
    e="${e//\'/\'\'}"
    echo "      - record: dashboard_query_$i"
    echo "        expr: '$e'"
  done <<< "$exprs"
} > "$tmp/dashboard-rules.yml"
"$promtool" check rules "$tmp/dashboard-rules.yml"
echo "PASS: $count dashboard queries parse"
