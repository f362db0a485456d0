#!/bin/bash
# Checks deploy/prometheus with Prometheus' own tools (Debian's `prometheus`
# package: /usr/bin/promtool and /usr/bin/prometheus):
#   1. promtool check config on both scrape configs (the Kubernetes one with
#      its service discovery swapped for a file, when promtool lacks it);
#   2. promtool check rules and promtool test rules (tests/*.yml);
#   3. every alert has a severity label and summary and description
#      annotations, and a unit test where it fires and one where it does
#      not; every recording rule has a unit test of its values;
#   4. the Kubernetes relabeling, run by a real Prometheus on made-up pods:
#      only colod's annotated metrics ports are scraped, with the labels the
#      rules and the dashboard expect.
# Run by `bazel test //deploy/prometheus:promtool_test`, or directly from
# deploy/prometheus/ (then TEST_TMPDIR defaults to a fresh directory).
set -euo pipefail

# fail(), $tmp, $promtool, and the working directory: deploy/prometheus/test_env.sh
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "${TEST_SRCDIR}/${TEST_WORKSPACE}/deploy/prometheus/test_env.sh" deploy/prometheus
else
  cd "$(dirname "${BASH_SOURCE[0]}")"
  source ../prometheus/test_env.sh deploy/prometheus
fi

echo "== promtool check config"
"$promtool" check config prometheus.yml

# Debian builds Prometheus without Kubernetes service discovery ("field
# kubernetes_sd_configs not found"): check the rest of the file with the
# discovery block replaced by a file_sd_configs one (which test 4 fills).
k8s_with_file_sd() {
  awk -v pods="$1" '
    /^ *kubernetes_sd_configs:/ {
      skip = 1
      indent = substr($0, 1, index($0, "k") - 1)
      print indent "file_sd_configs:"
      print indent "  - files: [\"" pods "\"]"
      next
    }
    skip && /^ *relabel_configs:/ { skip = 0 }
    !skip { print }
  ' prometheus-kubernetes.yml
}
mkdir -p "$tmp/k8s"
ln -sfn "$PWD/rules" "$tmp/k8s/rules"
k8s_with_file_sd "$tmp/k8s/pods.json" > "$tmp/k8s/prometheus.yml"
grep -q 'file_sd_configs' "$tmp/k8s/prometheus.yml" || fail "no kubernetes_sd_configs block in prometheus-kubernetes.yml"
if "$promtool" check config prometheus-kubernetes.yml > "$tmp/k8s-check.log" 2>&1; then
  cat "$tmp/k8s-check.log"
elif grep -q 'field kubernetes_sd_configs not found' "$tmp/k8s-check.log"; then
  echo "(this promtool has no Kubernetes discovery: checking prometheus-kubernetes.yml with file_sd_configs)"
  "$promtool" check config "$tmp/k8s/prometheus.yml"
else
  cat "$tmp/k8s-check.log" >&2
  fail "prometheus-kubernetes.yml"
fi

echo "== promtool check rules"
"$promtool" check rules rules/*.yml

echo "== promtool test rules"
"$promtool" test rules tests/*.yml

echo "== every alert is labelled, annotated and tested both ways; every recording rule is tested"
alerts="$(awk '$1 == "-" && $2 == "alert:" { print $3 }' rules/*.yml)"
records="$(awk '$1 == "-" && $2 == "record:" { print $3 }' rules/*.yml)"
[[ -n "$alerts" && -n "$records" ]] || fail "no alerts or no recording rules found in rules/*.yml"
# One line per alert: NAME SEVERITY HAS_SUMMARY HAS_DESCRIPTION.
awk '
  function flush() { if (name != "") print name, (sev == "" ? "-" : sev), summary, description }
  $1 == "-" && ($2 == "alert:" || $2 == "record:") {
    flush()
    name = ($2 == "alert:") ? $3 : ""
    sev = ""; summary = 0; description = 0
    next
  }
  $1 == "severity:" { sev = $2 }
  $1 == "summary:" { summary = 1 }
  $1 == "description:" { description = 1 }
  END { flush() }
' rules/*.yml > "$tmp/alerts.txt"
# One line per alert_rule_test case: ALERTNAME fires|silent.
awk '
  $1 == "alertname:" { name = $2 }
  $1 == "exp_alerts:" && name != "" { print name, ($2 == "[]" ? "silent" : "fires"); name = "" }
' tests/*.yml > "$tmp/cases.txt"
for alert in $alerts; do
  read -r _ severity summary description < <(grep "^$alert " "$tmp/alerts.txt")
  [[ "$severity" =~ ^(critical|warning|info)$ ]] || fail "alert $alert: severity '$severity' is not critical, warning or info"
  [[ "$summary" == 1 ]] || fail "alert $alert: no summary annotation"
  [[ "$description" == 1 ]] || fail "alert $alert: no description annotation"
  grep -qx "$alert fires" "$tmp/cases.txt" || fail "alert $alert: no unit test where it fires"
  grep -qx "$alert silent" "$tmp/cases.txt" || fail "alert $alert: no unit test where it stays silent"
  echo "  $alert ($severity): fires and stays silent in tests/"
done
for record in $records; do
  grep -Eq "^ *- expr: *$record(\{|$)" tests/*.yml || fail "recording rule $record: no promql_expr_test of its values"
  echo "  $record: values tested"
done

echo "== Kubernetes relabeling on a real Prometheus"
prometheus="$(command -v prometheus || true)"
[[ -n "$prometheus" ]] ||
  fail "prometheus is not on PATH ($PATH): install Debian's prometheus package (apt-get install prometheus)"
# Pods as Kubernetes discovery would describe them: one target per declared
# container port.
pod() {  # NAME COMPONENT APP SCRAPE ANNOTATED_PORT PORT HOST_NUMBER
  cat <<EOF
  {"targets": ["10.0.0.$7:$6"], "labels": {
    "__meta_kubernetes_namespace": "colod", "__meta_kubernetes_pod_name": "$1",
    "__meta_kubernetes_pod_node_name": "node-a",
    "__meta_kubernetes_pod_label_app_kubernetes_io_name": "$3",
    "__meta_kubernetes_pod_label_app_kubernetes_io_component": "$2",
    "__meta_kubernetes_pod_annotation_prometheus_io_scrape": "$4",
    "__meta_kubernetes_pod_annotation_prometheus_io_port": "$5",
    "__meta_kubernetes_pod_annotation_prometheus_io_path": "/metrics",
    "__meta_kubernetes_pod_container_port_number": "$6"}}
EOF
}
{
  echo "["
  pod colod-coordinator-0 coordinator colod true 9470 7070 1 && echo ","
  pod colod-coordinator-0 coordinator colod true 9470 9470 1 && echo ","
  pod colod-worker-0 worker colod true 9471 7071 2 && echo ","
  pod colod-worker-0 worker colod true 9471 9471 2 && echo ","
  pod colod-worker-1 worker colod false 9471 9471 3 && echo ","
  pod other-0 worker other true 9471 9471 4
  echo "]"
} > "$tmp/k8s/pods.json"
"$promtool" check config "$tmp/k8s/prometheus.yml" > /dev/null

# A free port: try a few.
targets=""
for attempt in 1 2 3 4 5; do
  port=$((20000 + RANDOM % 20000))
  rm -rf "$tmp/k8s/data"
  "$prometheus" --config.file="$tmp/k8s/prometheus.yml" --storage.tsdb.path="$tmp/k8s/data" \
    --web.listen-address="127.0.0.1:$port" > "$tmp/k8s/prometheus.log" 2>&1 &
  pid=$!
  # Targets reach the API within the scrape manager's 5 s update period.
  for _ in $(seq 1 60); do
    sleep 0.5
    kill -0 "$pid" 2> /dev/null || break
    targets="$( (exec 3<> "/dev/tcp/127.0.0.1/$port" &&
      printf 'GET /api/v1/targets?state=any HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3 && cat <&3) 2> /dev/null || true)"
    [[ "$( (grep -o '"health":' <<< "$targets" || true) | wc -l)" -ge 2 ]] && break
  done
  kill "$pid" 2> /dev/null || true
  wait "$pid" 2> /dev/null || true
  [[ -n "$targets" ]] && break
  grep -q 'address already in use' "$tmp/k8s/prometheus.log" || break
done
[[ -n "$targets" ]] || { cat "$tmp/k8s/prometheus.log" >&2; fail "Prometheus did not serve its targets"; }
active="$(grep -o '"labels":{[^}]*}' <<< "$targets" || true)"
want_coordinator='"labels":{"component":"coordinator","instance":"10.0.0.1:9470","job":"colod-coordinator","namespace":"colod","node":"node-a","pod":"colod-coordinator-0"}'
want_worker='"labels":{"component":"worker","instance":"10.0.0.2:9471","job":"colod-worker","namespace":"colod","node":"node-a","pod":"colod-worker-0"}'
grep -qxF "$want_coordinator" <<< "$active" || fail "no coordinator target $want_coordinator in: $active"
grep -qxF "$want_worker" <<< "$active" || fail "no worker target $want_worker in: $active"
[[ "$(wc -l <<< "$active")" == 2 ]] || fail "expected only the 2 metrics ports as targets, got: $active"
grep -q '"scrapeUrl":"http://10.0.0.1:9470/metrics"' <<< "$targets" || fail "coordinator scrape URL: $targets"
echo "  scraped: coordinator 10.0.0.1:9470 and worker 10.0.0.2:9471 with component, job, namespace, pod, node;"
echo "  dropped: gRPC ports, a pod with prometheus.io/scrape=false, another app's pod"

echo "PASS"
