#!/usr/bin/python3
"""A walk-through of driving colod from Python, that checks what it shows.

Against a running cluster with at least tp*dp idle workers (for example
`coloctl local --workers 4 --listen 127.0.0.1:0`, whose `ready:` line names
the address) and a model directory the workers can read
(`coloctl init-model --out DIR`):

  examples/python/gen_stubs.sh            # once: the stubs into examples/python/gen
  python3 examples/python/example.py --coordinator 127.0.0.1:7070 --model DIR

It
  1. waits until the coordinator serves (health check) and lists the workers;
  2. submits a TRAIN job (tp x dp, a few steps) with a request_id, then
     submits it again with the same request_id: the same job comes back;
  3. watches the job, drops the stream after its first training step (the
     client cancels the call), resumes with from_sequence = last + 1 and
     follows it to SUCCEEDED; replays the whole history and checks that no
     event was lost or repeated;
  4. reads the job's mesh (GetMesh), prints it and checks the 1D layout:
     tp groups {0,1},{2,3} and dp groups {0,2},{1,3} for tp=2 dp=2;
  5. uploads the model through the coordinator (UploadModel), submits a long
     job from the upload, cancels it once it runs: CANCELLED, and a second
     cancel is FAILED_PRECONDITION (not retried).

Every call has a deadline; --token-file and --tls-ca/--tls-cert/--tls-key
connect to a coordinator with a bearer token and (mutual) TLS. Exit status:
0 when every check passed, 1 on the first mismatch or failed call.
"""

import argparse
import sys
import time
import uuid

import grpc

import colod_client as cc
from colod_client import job_pb2


class CheckFailed(Exception):
    pass


def check(condition, what):
    if not condition:
        raise CheckFailed(what)


def train_spec(args, model, name, steps):
    return job_pb2.JobSpec(
        name=name,
        kind=job_pb2.JOB_KIND_TRAIN,
        model=model,
        shard=job_pb2.ShardConfig(tensor_parallel_size=args.tp, data_parallel_size=args.dp,
                                  tensor_parallel_mode=cc.mesh_pb2.TENSOR_PARALLEL_MODE_1D),
        train=job_pb2.TrainConfig(steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
                                  learning_rate=3e-3, optimizer=job_pb2.OPTIMIZER_ADAMW, seed=1,
                                  data_path=args.data, data_format="text"),
        labels={"example": "python"})


def step_1_health(c, args):
    print(f"== 1. health and workers of {c.address}")
    c.wait_until_serving(total_timeout=args.ready_timeout)
    workers = c.list_workers()
    for w in workers:
        print(f"  {w.info.worker_id} {w.info.address} {cc.worker_state_name(w.state)}")
    idle = [w for w in workers if w.state == cc.worker_pb2.WORKER_STATE_IDLE]
    check(len(idle) >= args.tp * args.dp, f"{len(idle)} idle workers, the job needs tp*dp = {args.tp * args.dp}")


def step_2_submit(c, args):
    print("== 2. submit a TRAIN job with a request_id, then retry the submit")
    request_id = args.request_id or f"example-{uuid.uuid4()}"
    spec = train_spec(args, cc.model_spec(args.model), "python-example", args.steps)
    # The coordinator forgets request ids when it restarts; a label lets a
    # client find the job again then (ListJobs) instead of submitting twice.
    spec.labels["request-id"] = request_id
    job = c.submit_job(spec, request_id=request_id)
    print(f"  submitted {job.job_id} ({cc.job_state_name(job.state)}), request_id {request_id}")
    # What a client does when the first answer was lost: the same request again.
    again = c.submit_job(spec, request_id=request_id)
    print(f"  the retried submit returned {again.job_id} ({cc.job_state_name(again.state)})")
    check(again.job_id == job.job_id, f"a retried submit created {again.job_id}, not {job.job_id}")
    check(again.create_time == job.create_time, "the retried submit's job has another create_time")
    return job.job_id


def step_3_watch(c, args, job_id):
    print(f"== 3. watch {job_id}, drop the stream after the first step, resume with from_sequence")
    seen = []
    # The first stream, taken by hand so that it can be dropped.
    stream = c.open_watch(job_id, from_sequence=1, timeout=args.watch_timeout)
    try:
        for event in stream:
            seen.append(event)
            print("  " + cc.format_event(event))
            check(event.sequence == len(seen), f"event {event.sequence} arrived as number {len(seen)}")
            if event.WhichOneof("event") == "step" or (
                    event.WhichOneof("event") == "state_change" and event.state_change.state in cc.FINAL_STATES):
                break
        # The connection "drops": whatever was in flight is gone.
        if stream.cancel():
            try:
                next(stream)
                raise CheckFailed("a cancelled stream went on")
            except grpc.RpcError as e:
                check(e.code() == grpc.StatusCode.CANCELLED, f"the dropped stream ended with {e.code().name}")
        else:
            print("  (the stream had already ended: nothing was in flight to drop)")
    finally:
        stream.cancel()
    check(seen, "the watch got no event")
    last = seen[-1].sequence
    print(f"  -- stream dropped after event #{last}; resuming with from_sequence={last + 1}")
    # The resumed watch reconnects by itself too (every --call-timeout seconds
    # or after UNAVAILABLE), each time from the next sequence.
    watch = c.watch_job(job_id, from_sequence=last + 1, call_timeout=args.call_timeout,
                        total_timeout=args.watch_timeout)
    for event in watch:
        seen.append(event)
        print("  " + cc.format_event(event))
    print(f"  the resumed watch ended after event #{watch.next_sequence - 1} "
          f"({watch.reconnects} more reconnects on its own)")

    sequences = [e.sequence for e in seen]
    check(sequences == list(range(1, len(seen) + 1)),
          f"events lost or repeated across the resume: sequences {sequences}")
    final = seen[-1]
    check(final.WhichOneof("event") == "state_change", "the stream did not end with a state change")
    check(final.state_change.state == job_pb2.JOB_STATE_SUCCEEDED,
          f"{job_id} ended {cc.job_state_name(final.state_change.state)}: {final.state_change.reason}")
    steps = [e.step.step for e in seen if e.WhichOneof("event") == "step"]
    check(steps == list(range(1, args.steps + 1)), f"step events {steps}, expected 1..{args.steps}")
    # The whole history again, in one stream: the same events, byte for byte.
    history = list(c.watch_job(job_id, from_sequence=1, call_timeout=args.call_timeout,
                               total_timeout=args.watch_timeout))
    check([e.SerializeToString() for e in history] == [e.SerializeToString() for e in seen],
          f"the replayed history ({len(history)} events) differs from the watched one ({len(seen)})")
    job = c.get_job(job_id)
    check(job.state == job_pb2.JOB_STATE_SUCCEEDED and job.step == args.steps,
          f"GetJob says {cc.job_state_name(job.state)} at step {job.step}")
    print(f"  {job_id} SUCCEEDED: {len(seen)} events, each once; step {job.step}, loss {job.loss:.4f}")


def step_4_mesh(c, args, job_id):
    print(f"== 4. the mesh of {job_id}")
    mesh = c.get_mesh(job_id)
    print("  " + cc.format_mesh(mesh).replace("\n", "\n  "))
    world = args.tp * args.dp
    check(mesh.world_size == world, f"world size {mesh.world_size}, expected {world}")
    check([r.rank for r in mesh.ranks] == list(range(world)), "the ranks are not 0..world-1 in order")
    check(len({r.worker_id for r in mesh.ranks}) == world, "two ranks share a worker")
    got = {(g.axis, g.index): list(g.ranks) for g in mesh.groups}
    want = cc.expected_groups(args.tp, args.dp)
    for key, ranks in sorted(want.items()):
        check(got.get(key) == ranks, f"group {key[0]}{key[1]}: {got.get(key)}, expected {ranks}")
    print("  layout checked: " + ", ".join(f"{a}{i}={r}" for (a, i), r in sorted(want.items())))


def step_5_upload_and_cancel(c, args):
    print("== 5. upload the model, submit a long job from the upload, cancel it while it runs")
    upload = c.upload_model(args.model)
    print(f"  {upload.upload_id}: {', '.join(upload.files)} ({upload.bytes} bytes)")
    spec = train_spec(args, cc.model_spec(args.model, upload_id=upload.upload_id), "python-example-cancel",
                      steps=1_000_000)
    job = c.submit_job(spec)
    print(f"  submitted {job.job_id}")
    watch = c.watch_job(job.job_id, call_timeout=args.call_timeout, total_timeout=args.watch_timeout)
    running = False
    for event in watch:
        print("  " + cc.format_event(event))
        if event.WhichOneof("event") == "step":
            running = True
            break  # leaving the loop cancels the stream
        if event.WhichOneof("event") == "state_change":
            check(event.state_change.state not in cc.FINAL_STATES,
                  f"{job.job_id} ended before it ran: {event.state_change.reason}")
    check(running, f"{job.job_id} never trained a step")
    cancelled = c.cancel_job(job.job_id, reason="python example: cancelled on purpose")
    print(f"  CancelJob: {cc.job_state_name(cancelled.state)} ({cancelled.reason})")
    check(cancelled.state == job_pb2.JOB_STATE_CANCELLED, f"{job.job_id} is {cc.job_state_name(cancelled.state)}")
    check(cancelled.reason == "python example: cancelled on purpose", f"reason '{cancelled.reason}'")
    try:
        c.cancel_job(job.job_id)
        raise CheckFailed("a second cancel succeeded")
    except cc.ColodError as e:
        check(e.code == grpc.StatusCode.FAILED_PRECONDITION, f"a second cancel: {e}")
        print(f"  a second CancelJob: {e.code.name} (not retried)")
    # The rest of the history ends with the CANCELLED state change.
    rest = c.watch_job(job.job_id, from_sequence=watch.next_sequence, call_timeout=args.call_timeout,
                       total_timeout=args.watch_timeout)
    for _ in rest:
        pass
    check(rest.final_event is not None and rest.final_event.state_change.state == job_pb2.JOB_STATE_CANCELLED,
          f"the watch of {job.job_id} did not end with CANCELLED")
    print(f"  the watch of {job.job_id} ended with: {cc.format_event(rest.final_event)}")
    return job.job_id


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cc.add_connection_flags(parser)
    parser.add_argument("--model", required=True, help="model directory every worker can read (weights_path)")
    parser.add_argument("--data", default="/usr/share/common-licenses/GPL-3", help="training text")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--request-id", help="the first job's idempotency key (default: a fresh one)")
    parser.add_argument("--call-timeout", type=float, default=30.0,
                        help="deadline of each WatchJob call; the watch resumes after it")
    parser.add_argument("--watch-timeout", type=float, default=300.0, help="give up a watch after this long")
    parser.add_argument("--ready-timeout", type=float, default=30.0, help="wait this long for the coordinator")
    args = parser.parse_args(argv)
    args.tp, args.dp = max(1, args.tp), max(1, args.dp)

    start = time.monotonic()
    try:
        with cc.client_from_flags(args) as c:
            step_1_health(c, args)
            job_id = step_2_submit(c, args)
            step_3_watch(c, args, job_id)
            step_4_mesh(c, args, job_id)
            step_5_upload_and_cancel(c, args)
    except CheckFailed as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    except cc.ColodError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    print(f"== all checks passed in {time.monotonic() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
