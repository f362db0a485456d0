#!/usr/bin/python3
"""A small Python client for colod's coordinator (colod.v1.CoordinatorService).

It wraps the stubs that gen_stubs.sh generates from proto/colod/v1/*.proto
with what every orchestration client of colod needs (docs/API.md explains
each rule):

  * a deadline on every call, so that no call hangs on a dead peer;
  * the bearer token as "authorization: Bearer <token>" metadata;
  * TLS or mutual-TLS channel credentials;
  * retries of UNAVAILABLE (and DEADLINE_EXCEEDED) with exponential backoff
    and jitter, only where repeating the call is harmless: reads, SubmitJob
    (always sent with a request_id), CancelJob;
  * WatchJob that resumes with from_sequence after a dropped stream and
    checks that every event arrives exactly once, in order.

Use it as a module (example.py walks through it) or as a small CLI:

  python3 colod_client.py --coordinator 127.0.0.1:7070 workers
  python3 colod_client.py --coordinator HOST:PORT --tls-ca ca.pem --token-file token health

The stubs are looked up in $COLOD_PY_STUBS, else in ./gen beside this file
(examples/python/gen_stubs.sh [DIR] writes them).

Thread-safety: a ColodClient may be shared between threads (gRPC channels
and stubs are thread-safe); a JobWatch belongs to the thread iterating it,
except cancel(), which any thread may call.
"""

import argparse
import dataclasses
import os
import random
import sys
import time
import uuid

import grpc


def _import_stubs():
    stubs = os.environ.get("COLOD_PY_STUBS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
    if stubs not in sys.path:
        sys.path.insert(0, stubs)
    try:
        from colod.v1 import coordinator_pb2, coordinator_pb2_grpc, job_pb2, mesh_pb2, worker_pb2
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as e:
        raise ImportError(
            f"colod's Python stubs are not in {stubs} ({e}); generate them with "
            f"examples/python/gen_stubs.sh {stubs}, or point COLOD_PY_STUBS at them") from e
    return coordinator_pb2, coordinator_pb2_grpc, job_pb2, mesh_pb2, worker_pb2, health_pb2, health_pb2_grpc


(coordinator_pb2, coordinator_pb2_grpc, job_pb2, mesh_pb2, worker_pb2, health_pb2,
 health_pb2_grpc) = _import_stubs()

COORDINATOR_SERVICE = "colod.v1.CoordinatorService"
FINAL_STATES = (job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)

# Files of a model directory that UploadModel sends (as `coloctl submit` does).
_MODEL_FILES = ("config.json", "model.safetensors.index.json")


class ColodError(Exception):
    """A failed call: the gRPC status code, the server's message, and the RPC."""

    def __init__(self, method, code, details):
        super().__init__(f"{method}: {code.name}: {details}")
        self.method = method
        self.code = code
        self.details = details


class WatchOrderError(RuntimeError):
    """WatchJob sent an event out of order: a gap or a repeat (never expected)."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter between attempts of one call."""

    max_attempts: int = 5
    initial_backoff: float = 0.2
    max_backoff: float = 5.0
    multiplier: float = 2.0

    def backoff(self, retry):
        """Seconds to sleep before retry number `retry` (1, 2, ...)."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier ** (retry - 1))
        return random.uniform(0, cap)


# Which codes a retry may follow. UNAVAILABLE: the coordinator could not be
# reached (or is restarting). DEADLINE_EXCEEDED: the answer may have been lost,
# so only calls that are safe to repeat retry it.
_RETRY_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_RETRY_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE,)


def job_state_name(state):
    """JOB_STATE_RUNNING -> "RUNNING"."""
    return job_pb2.JobState.Name(state).replace("JOB_STATE_", "")


def worker_state_name(state):
    """WORKER_STATE_IDLE -> "IDLE"."""
    return worker_pb2.WorkerState.Name(state).replace("WORKER_STATE_", "")


class ColodClient:
    """Typed calls to one coordinator, with deadlines, auth, TLS and retries."""

    def __init__(self, address, *, token=None, tls_ca=None, tls_cert=None, tls_key=None,
                 tls_server_name=None, timeout=10.0, retry=RetryPolicy()):
        """address: HOST:PORT. token: the bearer token (None: no auth).
        tls_ca: the CA's PEM file; it turns TLS on and verifies the server.
        tls_cert/tls_key: our certificate for a coordinator that requires
        mutual TLS. tls_server_name: the name to verify in the server's
        certificate when it differs from address's host.
        timeout: the deadline, in seconds, of each unary call attempt."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if tls_cert is not None and tls_ca is None:
            raise ValueError("tls_cert needs tls_ca (the CA that signed the coordinator's certificate)")
        self.address = address
        self.timeout = timeout
        self.retry = retry
        self._metadata = (("authorization", "Bearer " + token),) if token else ()
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca),
                private_key=_read(tls_key) if tls_key else None,
                certificate_chain=_read(tls_cert) if tls_cert else None)
            options = [("grpc.ssl_target_name_override", tls_server_name)] if tls_server_name else []
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            # A token over plaintext can be read by anyone on the path: use it
            # on loopback or a trusted network only.
            self._channel = grpc.insecure_channel(address)
        self._stub = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name, request, retry_on, timeout=None):
        """Calls a unary RPC, retrying the codes in `retry_on` with backoff."""
        method = getattr(self._stub, name)
        attempt = 1
        while True:
            try:
                return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() not in retry_on or attempt >= self.retry.max_attempts:
                    raise ColodError(name, e.code(), e.details()) from None
                time.sleep(self.retry.backoff(attempt))
                attempt += 1

    # Health and discovery.

    def health(self, service=COORDINATOR_SERVICE, timeout=None):
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... The health
        service needs no token. NOT_FOUND for a service the server lacks."""
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise ColodError("Health.Check", e.code(), e.details()) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def wait_until_serving(self, total_timeout=30.0):
        """Polls the health check until the coordinator serves its API."""
        deadline = time.monotonic() + total_timeout
        while True:
            try:
                if self.health(timeout=min(self.timeout, max(0.1, deadline - time.monotonic()))) == "SERVING":
                    return
                last = "NOT_SERVING"
            except ColodError as e:
                if e.code not in _RETRY_TRANSIENT:
                    raise
                last = str(e)
            if time.monotonic() >= deadline:
                raise ColodError("Health.Check", grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"{self.address} not serving after {total_timeout:g}s: {last}")
            time.sleep(0.2)

    def _all_pages(self, method, request, field):
        """The items (`field` of each response) of every page of a paged
        List call, `request` sent again with each next_page_token."""
        items = []
        while True:
            resp = self._call(method, request, _RETRY_TRANSIENT)
            items.extend(getattr(resp, field))
            if resp.next_page_token and resp.next_page_token == request.page_token:
                raise ColodError(method, grpc.StatusCode.DATA_LOSS,
                                 f"the coordinator sent page token '{request.page_token}' again")
            if not resp.next_page_token:
                return items
            request.page_token = resp.next_page_token

    def list_workers(self, include_lost=False):
        """Every registered worker, sorted by id (following the pages)."""
        return self._all_pages("ListWorkers", coordinator_pb2.ListWorkersRequest(include_lost=include_lost), "workers")

    # Jobs.

    def submit_job(self, spec, request_id=None):
        """Submits a JobSpec and returns the Job. The call always carries a
        request_id (a fresh one when none is given), which makes it safe to
        retry: a repeat returns the job the first attempt created. Pass your
        own request_id to make a submission idempotent across processes
        (until the coordinator restarts: see docs/API.md)."""
        req = coordinator_pb2.SubmitJobRequest(spec=spec, request_id=request_id or f"py-{uuid.uuid4()}")
        return self._call("SubmitJob", req, _RETRY_TRANSIENT).job

    def get_job(self, job_id):
        return self._call("GetJob", coordinator_pb2.GetJobRequest(job_id=job_id), _RETRY_TRANSIENT).job

    def list_jobs(self, states=(), full=False):
        """Every job in submission order (following the pages); summaries
        (no model config, mesh groups and ranks) unless `full`."""
        view = coordinator_pb2.JOB_VIEW_FULL if full else coordinator_pb2.JOB_VIEW_SUMMARY
        return self._all_pages("ListJobs", coordinator_pb2.ListJobsRequest(states=states, view=view), "jobs")

    def delete_job(self, job_id):
        """Forgets an ended job (FAILED_PRECONDITION while it runs)."""
        self._call("DeleteJob", coordinator_pb2.DeleteJobRequest(job_id=job_id), ())

    def cancel_job(self, job_id, reason=""):
        """Cancels a job and returns it. FAILED_PRECONDITION (ColodError) if
        it already ended. A retry whose first attempt may have landed gets
        FAILED_PRECONDITION too; then the job is fetched and returned as it
        is (CANCELLED by us, or ended otherwise: check its state)."""
        req = coordinator_pb2.CancelJobRequest(job_id=job_id, reason=reason)
        try:
            return self._call("CancelJob", req, ()).job
        except ColodError as e:
            if e.code not in _RETRY_TRANSIENT:
                raise
        time.sleep(self.retry.backoff(1))
        try:
            return self._call("CancelJob", req, _RETRY_TRANSIENT).job
        except ColodError as e:
            if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            return self.get_job(job_id)

    def get_mesh(self, job_id):
        """The job's MeshSpec; FAILED_PRECONDITION before ranks are assigned."""
        return self._call("GetMesh", coordinator_pb2.GetMeshRequest(job_id=job_id), _RETRY_TRANSIENT).mesh

    def open_watch(self, job_id, from_sequence=1, timeout=60.0):
        """One WatchJob stream, as gRPC returns it: iterate it for JobEvents,
        call .cancel() to drop it. Most callers want watch_job instead."""
        req = coordinator_pb2.WatchJobRequest(job_id=job_id, from_sequence=from_sequence)
        return self._stub.WatchJob(req, timeout=timeout, metadata=self._metadata)

    def watch_job(self, job_id, from_sequence=1, call_timeout=60.0, total_timeout=None):
        """A JobWatch: the job's events from from_sequence to its final
        state, each exactly once, across reconnects."""
        return JobWatch(self, job_id, from_sequence, call_timeout, total_timeout)

    # Models.

    def upload_model(self, directory, chunk_bytes=1 << 20, timeout=300.0):
        """Streams a model directory (config.json, *.safetensors and the
        index) to the coordinator; returns the UploadModelResponse whose
        upload_id a ModelSpec names. UNAVAILABLE is retried by sending the
        whole directory again (an upload becomes visible only once
        complete; a lost answer leaves an unused upload behind)."""
        files = sorted(f for f in os.listdir(directory)
                       if os.path.isfile(os.path.join(directory, f))
                       and (f.endswith(".safetensors") or f in _MODEL_FILES))
        if not any(f.endswith(".safetensors") for f in files):
            raise FileNotFoundError(f"{directory} holds no .safetensors file")

        def chunks():
            for name in files:
                with open(os.path.join(directory, name), "rb") as f:
                    offset = 0
                    while True:
                        data = f.read(chunk_bytes)
                        if data or offset == 0:  # an empty file still sends its one chunk
                            yield coordinator_pb2.UploadModelRequest(
                                chunk=coordinator_pb2.ModelChunk(file=name, offset=offset, data=data))
                        offset += len(data)
                        if len(data) < chunk_bytes:
                            break

        attempt = 1
        while True:
            try:
                return self._stub.UploadModel(chunks(), timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() not in _RETRY_UNAVAILABLE or attempt >= self.retry.max_attempts:
                    raise ColodError("UploadModel", e.code(), e.details()) from None
                time.sleep(self.retry.backoff(attempt))
                attempt += 1


class JobWatch:
    """Iterates a job's events from from_sequence until the event that puts
    the job in a final state (then the server ends the stream).

    Each WatchJob call gets call_timeout seconds; when it expires
    (DEADLINE_EXCEEDED) or the connection drops (UNAVAILABLE), the watch
    reconnects with from_sequence = the last sequence it yielded + 1, so no
    event is lost or repeated, and checks that the sequence numbers continue
    without a gap. total_timeout (seconds, None: none) bounds the whole watch.

    Attributes: next_sequence (the next event's sequence), reconnects (how
    many times it resumed), final_event (the state change to a final state,
    once yielded). A watch that ends without a final_event started past the
    job's last event: ask GetJob for the state.
    """

    def __init__(self, client, job_id, from_sequence=1, call_timeout=60.0, total_timeout=None):
        self._client = client
        self.job_id = job_id
        self.next_sequence = max(from_sequence, 1)
        self.call_timeout = call_timeout
        self.reconnects = 0
        self.final_event = None
        self._deadline = None if total_timeout is None else time.monotonic() + total_timeout
        self._call = None
        self._cancelled = False

    def cancel(self):
        """Ends the watch: the current stream is cancelled, iteration stops."""
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()

    def __iter__(self):
        failures = 0  # consecutive attempts that got no event
        while not self._cancelled:
            timeout = self.call_timeout
            if self._deadline is not None:
                timeout = min(timeout, self._deadline - time.monotonic())
                if timeout <= 0:
                    raise ColodError("WatchJob", grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"{self.job_id}: no final state within the watch's total timeout "
                                     f"(next sequence {self.next_sequence})")
            self._call = self._client.open_watch(self.job_id, self.next_sequence, timeout)
            try:
                for event in self._call:
                    if event.sequence != self.next_sequence:
                        self._call.cancel()
                        raise WatchOrderError(f"{self.job_id}: event {event.sequence} arrived, "
                                              f"expected {self.next_sequence}")
                    self.next_sequence += 1
                    failures = 0
                    if event.WhichOneof("event") == "state_change" and event.state_change.state in FINAL_STATES:
                        self.final_event = event
                    yield event
                return  # the server ended the stream: the job reached a final state
            except grpc.RpcError as e:
                code = e.code()
                if self._cancelled and code == grpc.StatusCode.CANCELLED:
                    return
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    pass  # the call's time is up, not the job's: resume at once
                elif code == grpc.StatusCode.UNAVAILABLE:
                    failures += 1
                    if failures >= self._client.retry.max_attempts:
                        raise ColodError("WatchJob", code, e.details()) from None
                    time.sleep(self._client.retry.backoff(failures))
                else:
                    raise ColodError("WatchJob", code, e.details()) from None
                self.reconnects += 1
            finally:
                # A no-op once the stream ended; frees it when the caller stops early.
                self._call.cancel()


def model_spec(directory, upload_id=None):
    """A ModelSpec for a Hugging Face-style directory: config.json inline and
    either weights_path (the absolute directory, which every worker must be
    able to read) or an upload_id from upload_model()."""
    spec = job_pb2.ModelSpec(config_json=_read(os.path.join(directory, "config.json")).decode())
    if upload_id:
        spec.upload_id = upload_id
    else:
        spec.weights_path = os.path.abspath(directory)
    return spec


def expected_groups(tp, dp):
    """The process groups of a 1D tp x dp mesh (ColossalAI's layout):
    tp group i = ranks [i*tp, ..., i*tp+tp-1]; dp group j = [j, j+tp, ...].
    Returns {(axis, index): [ranks]}."""
    groups = {("tp", i): [i * tp + k for k in range(tp)] for i in range(dp)}
    groups.update({("dp", j): [j + k * tp for k in range(dp)] for j in range(tp)})
    return groups


def format_mesh(mesh):
    """A MeshSpec as `coloctl mesh` draws it: a row per dp replica, a column
    per tp rank, then every group."""
    axes = " x ".join(f"{a.name}={a.size}" for a in mesh.axes)
    lines = [f"{mesh.world_size} ranks, axes {axes} (outermost first)"]
    tp = 1
    for a in mesh.axes:
        if a.name.startswith("tp"):
            tp *= a.size
    if tp < 1 or mesh.world_size % tp:
        tp = mesh.world_size
    for row in range(mesh.world_size // tp):
        cells = []
        for col in range(tp):
            rank = row * tp + col
            cell = f"rank {rank}"
            if rank < len(mesh.ranks):
                r = mesh.ranks[rank]
                cell += f" {r.worker_id} {r.worker_address}"
            cells.append(cell)
        lines.append(f"  dp{row}: " + " | ".join(cells))
    lines.append("groups:")
    for g in mesh.groups:
        lines.append(f"  {g.axis}{g.index}: {{{','.join(str(r) for r in g.ranks)}}}")
    return "\n".join(lines)


def format_event(event):
    """One JobEvent as a line."""
    kind = event.WhichOneof("event")
    if kind == "state_change":
        what = f"state {job_state_name(event.state_change.state)}: {event.state_change.reason}"
    elif kind == "step":
        s = event.step
        what = f"step {s.step} loss {s.loss:.4f} lr {s.learning_rate:.2e} {s.tokens_per_second:.0f} tok/s"
    elif kind == "rank_status":
        r = event.rank_status
        phase = job_pb2.RankPhase.Name(r.phase).replace("RANK_PHASE_", "").lower()
        what = f"rank {r.rank} {phase}" + (f": {r.message}" if r.message else "")
    else:
        what = "(unknown event)"
    return f"{event.job_id} #{event.sequence} {what}"


def _read(path):
    with open(path, "rb") as f:
        return f.read()


def add_connection_flags(parser):
    """--coordinator, --timeout, --token-file and the TLS flags, as coloctl names them."""
    parser.add_argument("--coordinator", default=os.environ.get("COLOD_COORDINATOR"),
                        help="HOST:PORT of the coordinator (default $COLOD_COORDINATOR)")
    parser.add_argument("--timeout", type=float, default=10.0, help="deadline of each call, seconds")
    parser.add_argument("--token-file", default=os.environ.get("COLOD_AUTH_TOKEN_FILE"),
                        help="file with the bearer token (default $COLOD_AUTH_TOKEN_FILE)")
    parser.add_argument("--tls-ca", help="PEM CA: use TLS and verify the coordinator against it")
    parser.add_argument("--tls-cert", help="PEM certificate to present (mutual TLS)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", help="name to verify in the coordinator's certificate")
    parser.add_argument("--max-attempts", type=int, default=RetryPolicy.max_attempts,
                        help="attempts of a retryable call")


def client_from_flags(args):
    if not args.coordinator:
        raise SystemExit("--coordinator (or $COLOD_COORDINATOR) is required")
    token = None
    if args.token_file:
        token = _read(args.token_file).decode().strip()
        if not token:
            raise SystemExit(f"--token-file: {args.token_file} is empty")
    return ColodClient(args.coordinator, token=token, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                       tls_key=args.tls_key, tls_server_name=args.tls_server_name, timeout=args.timeout,
                       retry=RetryPolicy(max_attempts=max(1, args.max_attempts)))


def main(argv=None):
    parser = argparse.ArgumentParser(description="A small colod client (see docs/API.md).")
    add_connection_flags(parser)
    parser.add_argument("command", choices=["health", "workers", "jobs", "watch", "mesh", "cancel"])
    parser.add_argument("job_id", nargs="?", help="watch, mesh, cancel: the job")
    parser.add_argument("--reason", default="", help="cancel: why")
    args = parser.parse_args(argv)
    if args.command in ("watch", "mesh", "cancel") and not args.job_id:
        parser.error(f"{args.command} needs a JOB_ID")
    try:
        with client_from_flags(args) as c:
            if args.command == "health":
                print(c.health())
            elif args.command == "workers":
                for w in c.list_workers():
                    print(w.info.worker_id, w.info.address, worker_state_name(w.state))
            elif args.command == "jobs":
                for j in c.list_jobs():
                    print(j.job_id, j.spec.name, job_state_name(j.state), j.step, f"{j.loss:.4f}", j.reason)
            elif args.command == "watch":
                for ev in c.watch_job(args.job_id):
                    print(format_event(ev), flush=True)
            elif args.command == "mesh":
                print(format_mesh(c.get_mesh(args.job_id)))
            elif args.command == "cancel":
                j = c.cancel_job(args.job_id, args.reason)
                print(j.job_id, job_state_name(j.state), j.reason)
    except ColodError as e:
        print(f"colod_client: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
