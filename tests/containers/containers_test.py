#!/usr/bin/env python3
"""colod in real containers: a coordinator and 4 workers on one podman network.

Run through `./dev test-containers` (which builds the images first). What it
checks, each as one named test:
  - the image: non-root user, no compiler or Bazel inside, the HEALTHCHECK
    reports healthy through the gRPC health service;
  - 4 worker containers register with the coordinator container by name;
  - a TRAIN job submitted from the host's coloctl through a published port runs
    tp=2 dp=2 to SUCCEEDED with the losses of the same job on an embedded
    cluster (coloctl train on the host);
  - a Prometheus container (Debian's prometheus package) scrapes all five
    daemons, loads deploy/prometheus/rules, and PromQL over its HTTP API
    returns what the cluster did (workers ready, a histogram_quantile over the
    step-duration histogram, the tokens trained);
  - `podman kill` of one worker container mid-job ends the job (submitted with
    --max-restarts 0) FAILED naming
    that worker within the lease, and the other workers take the next job;
  - SIGTERM (podman stop) ends the daemons cleanly, with exit status 0.
Everything it creates (containers, network, volume, files) is removed at the
end, also on failure or SIGINT/SIGTERM. Prints `containers: N passed, M failed`.
Standard library only.
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

LEASE_S = 10  # the coordinator's default --lease-duration
GPL = "/usr/share/common-licenses/GPL-3"  # in every Debian image (base-files)


class Failure(Exception):
    pass


def run(args, check=True, timeout=300, capture=True, env=None):
    """Runs a command; returns stdout. Raises Failure naming the command on error."""
    try:
        p = subprocess.run(args, stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE,
                           text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        raise Failure(f"timed out after {timeout}s: {' '.join(args)}")
    if check and p.returncode != 0:
        raise Failure(f"exit {p.returncode}: {' '.join(args)}\n{(p.stdout or '')[-2000:]}{p.stderr[-2000:]}")
    return p.stdout if capture else ""


def wait_for(what, fn, timeout, interval=0.5):
    """Polls fn() until it returns a truthy value; raises Failure after timeout."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except Failure as e:
            last = str(e)
        time.sleep(interval)
    raise Failure(f"{what}: not within {timeout}s (last: {last})")


class Cluster:
    """The containers of one test run, all labelled colod-test=RUN_ID."""

    def __init__(self, args):
        self.args = args
        self.run_id = f"colod-ct-{os.getpid()}"
        self.net = self.run_id
        self.volume = f"{self.run_id}-data"
        self.tmp = tempfile.mkdtemp(prefix="colod-containers.")
        self.port = None
        self.prom_port = None

    def name(self, role):
        return f"{self.run_id}-{role}"

    def podman_run(self, role, image, cmd, extra=()):
        args = ["podman", "run", "-d", "--name", self.name(role), "--label", f"colod-test={self.run_id}",
                "--network", self.net, "--network-alias", role, "--hostname", role, *extra, image, *cmd]
        return run(args).strip()

    def start(self):
        run(["podman", "network", "create", "--label", f"colod-test={self.run_id}", self.net])
        run(["podman", "volume", "create", "--label", f"colod-test={self.run_id}", self.volume])
        # The image's default command is the coordinator with its data on the volume.
        self.podman_run("coordinator", self.args.image, [],
                        ["-p", "127.0.0.1::7070", "-v", f"{self.volume}:/var/lib/colod"])
        for i in range(4):
            self.podman_run(f"worker-{i}", self.args.image,
                            ["colod-worker", "--coordinator", "coordinator:7070", "--advertise-host", f"worker-{i}",
                             "--device", "cpu", "--labels", f"node=worker-{i}", "--comm-timeout", "30s"])
        self.port = self.published("coordinator", 7070)
        self.coloctl_base = [self.args.coloctl, "--coordinator", f"127.0.0.1:{self.port}", "--timeout", "20s"]

    def start_prometheus(self):
        conf = os.path.join(self.tmp, "prometheus.yml")
        with open(conf, "w") as f:
            f.write(prometheus_config())
        os.chmod(self.tmp, 0o755)
        os.chmod(conf, 0o644)
        extra = ["-p", "127.0.0.1::9090", "-v", f"{conf}:/etc/colod-prometheus/prometheus.yml:ro"]
        if self.args.rules and os.path.isdir(self.args.rules):
            extra += ["-v", f"{os.path.abspath(self.args.rules)}:/etc/colod-prometheus/rules:ro"]
        self.podman_run("prometheus", self.args.prometheus_image, [], extra)
        self.prom_port = self.published("prometheus", 9090)

    def published(self, role, port):
        out = wait_for(f"{role}'s published port", lambda: run(["podman", "port", self.name(role), f"{port}/tcp"]).strip(),
                       30)
        return int(out.splitlines()[0].rsplit(":", 1)[1])

    def coloctl(self, *args, timeout=300, check=True):
        return run([*self.coloctl_base, *args], timeout=timeout, check=check)

    def logs(self):
        out = []
        for role in ["coordinator"] + [f"worker-{i}" for i in range(4)] + ["prometheus"]:
            p = subprocess.run(["podman", "logs", "--tail", "25", self.name(role)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            out.append(f"--- {role}\n{p.stdout}")
        return "\n".join(out)

    def remove(self):
        label = f"label=colod-test={self.run_id}"
        ids = run(["podman", "ps", "-aq", "--filter", label], check=False).split()
        if ids:
            run(["podman", "rm", "-f", "-t", "0", *ids], check=False)
        run(["podman", "network", "rm", "-f", self.net], check=False)
        run(["podman", "volume", "rm", "-f", self.volume], check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


def prometheus_config():
    workers = ", ".join(f"'worker-{i}:9471'" for i in range(4))
    return f"""# Written by tests/containers/containers_test.py
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ['/etc/colod-prometheus/rules/*.yml']
scrape_configs:
  - job_name: colod-coordinator
    static_configs: [{{targets: ['coordinator:9470'], labels: {{component: coordinator}}}}]
  - job_name: colod-worker
    static_configs: [{{targets: [{workers}], labels: {{component: worker}}}}]
"""


def promql(port, query):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise Failure(f"PromQL {query}: {body}")
    return body["data"]["result"]


def step_losses(lines):
    """Losses by step from JSON lines: coloctl train's {"step", "loss"} or JobEvents {"step": {...}}."""
    losses = {}
    for line in lines.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        step = ev.get("step")
        if isinstance(step, dict):  # a JobEvent (proto3 JSON: int64 as strings)
            losses[int(step.get("step", 0))] = float(step["loss"])
        elif step is not None:
            losses[int(step)] = float(ev["loss"])
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--coloctl", required=True, help="the host's coloctl (the embedded reference and the client)")
    ap.add_argument("--image", default="localhost/colod:latest")
    ap.add_argument("--prometheus-image", default="localhost/colod-test-prometheus:latest")
    ap.add_argument("--rules", default="", help="a folder of Prometheus rule files to load")
    ap.add_argument("--cuda-image", default="", help="also check this colod-cuda image (no GPU needed)")
    args = ap.parse_args()

    cluster = Cluster(args)
    results = []

    def on_signal(signum, _frame):
        cluster.remove()
        sys.exit(128 + signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def test(name, fn):
        t0 = time.monotonic()
        try:
            fn()
            results.append((name, None))
            print(f"[ PASS ] {name} ({time.monotonic() - t0:.1f}s)", flush=True)
        except Exception as e:  # a failed check, or a broken one: both are failures
            results.append((name, e))
            print(f"[ FAIL ] {name} ({time.monotonic() - t0:.1f}s): {e}", flush=True)
        return results[-1][1] is None

    model = os.path.join(cluster.tmp, "gpt2")
    train_flags = ["--data", GPL, "--tp", "2", "--dp", "2", "--mode", "1d", "--steps", "8", "--batch-size", "8",
                   "--seq-len", "32", "--lr", "3e-3", "--warmup-steps", "2", "--seed", "7"]
    state = {}

    try:
        def image_is_slim_and_non_root():
            uid = run(["podman", "run", "--rm", args.image, "id", "-u"]).strip()
            if uid != "10001":
                raise Failure(f"the image runs as uid {uid}, want the non-root 10001")
            tools = run(["podman", "run", "--rm", args.image, "sh", "-c",
                         "for t in g++ gcc cc bazel nvcc javac; do command -v $t; done; true"]).strip()
            if tools:
                raise Failure(f"build tools in the runtime image: {tools}")
            for b in ["colod-coordinator", "colod-worker", "coloctl"]:
                if "colod" not in run(["podman", "run", "--rm", args.image, b, "--version"]):
                    raise Failure(f"{b} --version does not run")

        test("image: non-root, runtime only, binaries on PATH", image_is_slim_and_non_root)

        def cuda_image():
            img = args.cuda_image
            uid = run(["podman", "run", "--rm", img, "id", "-u"]).strip()
            if uid != "10001":
                raise Failure(f"the CUDA image runs as uid {uid}, want the non-root 10001")
            # The binaries take cudart, cuBLAS and NCCL from CUDA_BASE, the rest from /opt/colod/lib.
            for b in ["colod-coordinator", "colod-worker", "coloctl"]:
                libs = run(["podman", "run", "--rm", img, "ldd", f"/usr/local/bin/{b}"])
                if "not found" in libs:
                    raise Failure(f"{b} misses libraries in the CUDA image:\n{libs}")
                if b == "colod-worker":
                    for lib in ["libcudart.so", "libcublas.so", "libcublasLt.so", "libnccl.so"]:
                        if f"{lib}" not in libs:
                            raise Failure(f"colod-worker does not load {lib} in the CUDA image:\n{libs}")
            # No GPU is handed to this container: the worker must say so and
            # exit with an error, neither crash nor hang.
            try:
                p = subprocess.run(["podman", "run", "--rm", img, "colod-worker", "--device", "cuda",
                                    "--coordinator", "127.0.0.1:1"], capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired:
                raise Failure("colod-worker --device cuda without a GPU did not exit within 120 s")
            if p.returncode != 1 or "no CUDA device" not in p.stderr:
                raise Failure(f"colod-worker --device cuda without a GPU: exit {p.returncode}, want 1 and "
                              f"'no CUDA device':\n{p.stderr[-1500:]}")
            # The coordinator serves from the CUDA image too, and its HEALTHCHECK command passes.
            run(["podman", "run", "--rm", img, "sh", "-c",
                 "colod-coordinator --data-dir /var/lib/colod/data & "
                 "for i in $(seq 150); do colod-healthcheck >/dev/null 2>&1 && exit 0; sleep 0.2; done; "
                 "colod-healthcheck; exit 1"], timeout=120)

        if args.cuda_image:
            test("cuda image: non-root, CUDA libraries from its base, no-GPU error, coordinator healthy",
                 cuda_image)

        run([args.coloctl, "init-model", "--out", model, "--vocab-size", "257", "--hidden-size", "32",
             "--layers", "2", "--heads", "4", "--positions", "64"])
        cluster.start()
        cluster.start_prometheus()

        def workers_register():
            def ready():
                out = json.loads(cluster.coloctl("workers", "--output", "json"))
                ws = [w for w in out.get("workers", []) if w.get("state") in ("WORKER_STATE_IDLE", "WORKER_STATE_BUSY")]
                return ws if len(ws) == 4 else None
            ws = wait_for("4 workers registered", ready, 90)
            addrs = sorted(w["info"]["address"] for w in ws)
            if addrs != [f"worker-{i}:7071" for i in range(4)]:
                raise Failure(f"worker addresses {addrs}, want worker-i:7071 (reached by container name)")

        if not test("4 worker containers register with the coordinator by name", workers_register):
            raise Failure("no cluster")

        def healthchecks():
            for role in ["coordinator", "worker-0"]:
                p = subprocess.run(["podman", "healthcheck", "run", cluster.name(role)], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, timeout=60)
                if p.returncode != 0:
                    raise Failure(f"HEALTHCHECK of {role}: exit {p.returncode}: {p.stdout}")
            # And the probe can fail: a readiness name nobody serves is not SERVING.
            p = subprocess.run(["podman", "exec", cluster.name("worker-0"), "coloctl", "health", "127.0.0.1:7071",
                                "--service", "colod.v1.CoordinatorService", "--timeout", "3s"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
            if p.returncode == 0:
                raise Failure(f"a worker claims to serve CoordinatorService: {p.stdout}")

        test("HEALTHCHECK: healthy through the gRPC health service", healthchecks)

        def train_matches_embedded():
            ref = step_losses(run([args.coloctl, "train", "--model", model, *train_flags, "--output", "json"],
                                  timeout=600))
            out = cluster.coloctl("submit", "--model", model, *train_flags, "--name", "in-containers", "--watch",
                                  "--output", "json", timeout=600)
            got = step_losses(out)
            if sorted(ref) != list(range(1, 9)) or sorted(got) != sorted(ref):
                raise Failure(f"steps: embedded {sorted(ref)}, containers {sorted(got)}")
            for s in ref:
                if not math.isfinite(got[s]) or abs(got[s] - ref[s]) > 1e-5 * max(1.0, abs(ref[s])):
                    raise Failure(f"step {s}: loss {got[s]} in containers, {ref[s]} embedded")
            job = json.loads(cluster.coloctl("jobs", "--output", "json"))["jobs"][-1]
            if job["state"] != "JOB_STATE_SUCCEEDED":
                raise Failure(f"job {job['jobId']} {job['state']}: {job.get('reason')}")
            state["first_job"] = job["jobId"]
            state["losses"] = ref

        test("TRAIN tp=2 dp=2 in containers: SUCCEEDED with the embedded cluster's losses", train_matches_embedded)

        def prometheus_sees_the_cluster():
            p = cluster.prom_port

            def all_up():
                r = promql(p, "up == 1")
                return len(r) == 5 and r
            wait_for("5 targets up", all_up, 60)
            # Ready workers: registered and heartbeating (idle or running a rank).
            ready = wait_for("colod_workers{state=idle|busy}",
                             lambda: promql(p, 'sum(colod_workers{state=~"idle|busy"})'), 30)
            if float(ready[0]["value"][1]) != 4:
                raise Failure(f"sum(colod_workers{{state=~idle|busy}}) = {ready[0]['value'][1]}, want 4")
            if "losses" not in state:
                raise Failure("no job ran")
            # Every rank observed 8 steps; rank 0..3 each on one worker.
            steps = wait_for("8 steps per worker in colod_step_duration_seconds_count",
                             lambda: (lambda r: r if len(r) == 4 and all(float(x["value"][1]) == 8 for x in r) else None)(
                                 promql(p, "sum by (instance) (max_over_time(colod_step_duration_seconds_count[10m]))")), 30)
            # Over the last 10 minutes, so series a finished rank dropped still count.
            q = promql(p, "histogram_quantile(0.5, sum by (le) (max_over_time(colod_step_duration_seconds_bucket[10m])))")
            v = float(q[0]["value"][1]) if q else float("nan")
            mean = promql(p, "sum(max_over_time(colod_step_duration_seconds_sum[10m])) / "
                             "sum(max_over_time(colod_step_duration_seconds_count[10m]))")
            m = float(mean[0]["value"][1])
            if not (math.isfinite(v) and v > 0 and m > 0):
                raise Failure(f"step time p50 {v}, mean {m}: want finite and positive")
            # Tokens: each rank counts its share, so the sum over the ranks is the
            # job's 8 steps x batch 8 x 32 tokens.
            tokens = float(promql(p, "sum(max_over_time(colod_tokens_total[10m]))")[0]["value"][1])
            if tokens != 8 * 8 * 32:
                raise Failure(f"sum(colod_tokens_total) = {tokens}, want {8 * 8 * 32}")
            state["prom"] = {"p50": v, "mean": m, "steps": len(steps)}
            if args.rules and os.path.isdir(args.rules):
                rules = json.load(urllib.request.urlopen(f"http://127.0.0.1:{p}/api/v1/rules", timeout=10))
                groups = rules["data"]["groups"]
                health = [r.get("health") for g in groups for r in g["rules"]]
                if not groups or any(h not in ("ok", "unknown") for h in health):
                    raise Failure(f"rules not loaded or failing: {health}")

        test("Prometheus scrapes all five daemons; PromQL returns what the cluster did", prometheus_sees_the_cluster)

        def killed_worker_fails_the_job():
            job = cluster.coloctl("submit", "--model", model, "--data", GPL, "--tp", "2", "--dp", "2", "--steps",
                                  "100000", "--batch-size", "8", "--seq-len", "32", "--lr", "1e-3",
                                  "--max-restarts", "0", "--name", "doomed").strip()

            def stepping():
                j = json.loads(cluster.coloctl("status", job, "--output", "json"))
                return int(j.get("step", 0)) >= 2 and j
            wait_for(f"{job} at step 2", stepping, 120)
            mesh = json.loads(cluster.coloctl("mesh", job, "--output", "json"))
            victim = mesh["ranks"][1]["workerAddress"].split(":")[0]
            victim_id = mesh["ranks"][1]["workerId"]
            t_kill = time.monotonic()
            run(["podman", "kill", "--signal", "KILL", cluster.name(victim)])

            def ended():
                j = json.loads(cluster.coloctl("status", job, "--output", "json"))
                return j["state"] not in ("JOB_STATE_RUNNING", "JOB_STATE_SCHEDULED", "JOB_STATE_PENDING") and j
            j = wait_for(f"{job} to end after {victim} was killed", ended, LEASE_S + 20)
            took = time.monotonic() - t_kill
            if j["state"] != "JOB_STATE_FAILED":
                raise Failure(f"{job} {j['state']}: {j.get('reason')}")
            if victim_id not in j.get("reason", "") and victim not in j.get("reason", ""):
                raise Failure(f"the reason does not name the killed worker {victim_id} ({victim}): {j.get('reason')}")
            if took > LEASE_S + 2:
                raise Failure(f"FAILED {took:.1f}s after the kill, want within the {LEASE_S}s lease")
            state["victim"] = victim
            # The three survivors take the next job (tp=2 dp=1).
            nxt = cluster.coloctl("submit", "--model", model, "--data", GPL, "--tp", "2", "--dp", "1", "--steps", "3",
                                  "--batch-size", "4", "--seq-len", "32", "--name", "after-the-kill", "--watch",
                                  "--output", "json", timeout=300)
            done = json.loads(cluster.coloctl("jobs", "--output", "json"))["jobs"][-1]
            if done["state"] != "JOB_STATE_SUCCEEDED" or len(step_losses(nxt)) != 3:
                raise Failure(f"the next job {done['jobId']} {done['state']}: {done.get('reason')}")
            used = [r["workerAddress"] for r in json.loads(cluster.coloctl("mesh", done["jobId"], "--output", "json"))["ranks"]]
            if any(a.startswith(victim + ":") for a in used):
                raise Failure(f"the next job ran on the killed worker: {used}")

        test("podman kill of a worker mid-job: FAILED naming it within the lease; survivors take the next job",
             killed_worker_fails_the_job)

        def sigterm_is_clean():
            for role in ["worker-0", "coordinator"]:
                t0 = time.monotonic()
                run(["podman", "stop", "-t", "20", cluster.name(role)], timeout=60)
                took = time.monotonic() - t0
                code = run(["podman", "inspect", "--format", "{{.State.ExitCode}}", cluster.name(role)]).strip()
                if code != "0" or took > 15:
                    raise Failure(f"{role}: exit status {code} after {took:.1f}s on SIGTERM, want 0 well before the kill")

        test("SIGTERM (podman stop) ends the daemons cleanly with status 0", sigterm_is_clean)
    except Failure as e:
        results.append(("cluster setup", e))
        print(f"[ FAIL ] cluster setup: {e}", flush=True)
    finally:
        if any(err is not None for _, err in results):
            print(cluster.logs(), flush=True)
        cluster.remove()

    failed = sum(1 for _, err in results if err is not None)
    print(f"containers: {len(results) - failed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
