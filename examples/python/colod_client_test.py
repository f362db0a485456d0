#!/usr/bin/python3
"""colod_client against a scripted in-process CoordinatorService on loopback:
the failures a real coordinator rarely shows on cue (dropped streams,
UNAVAILABLE, lost answers, out-of-order events), and what goes on the wire
(request ids, the bearer token, upload chunks).

Run: COLOD_PY_STUBS=DIR python3 colod_client_test.py (run_py_test.sh does it).
"""

import concurrent.futures
import os
import tempfile
import threading
import time
import unittest

import grpc

import colod_client as cc
from colod_client import coordinator_pb2, coordinator_pb2_grpc, job_pb2

FAST = cc.RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.02)


def event(seq, final=False):
    ev = job_pb2.JobEvent(job_id="job-000001", sequence=seq)
    if final:
        ev.state_change.state = job_pb2.JOB_STATE_SUCCEEDED
    else:
        ev.step.step = seq
    return ev


class FakeCoordinator(coordinator_pb2_grpc.CoordinatorServiceServicer):
    """Serves a job with `events` events (the last one final); each test
    scripts the failures through the attributes below."""

    def __init__(self):
        self.lock = threading.Lock()
        self.events = 10
        self.watch_requests = []     # from_sequence of every WatchJob call
        self.drop_after = {}         # call number -> events sent before UNAVAILABLE
        self.stall_after = {}        # call number -> events sent before stalling
        self.skip = None             # a sequence number never sent (a gap)
        self.unavailable = {}        # method -> failures left before it answers
        self.calls = {}              # method -> calls
        self.metadata = []
        self.submitted = []          # request ids
        self.cancel_sleep = 0.0      # CancelJob answers this late (after cancelling)
        self.cancelled = False
        self.chunks = []

    def _enter(self, method, context):
        with self.lock:
            self.calls[method] = self.calls.get(method, 0) + 1
            self.metadata.append(dict(context.invocation_metadata()))
            left = self.unavailable.get(method, 0)
            if left:
                self.unavailable[method] = left - 1
        if left:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted outage")

    def GetJob(self, request, context):
        self._enter("GetJob", context)
        if request.job_id != "job-000001":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job '{request.job_id}'")
        state = job_pb2.JOB_STATE_CANCELLED if self.cancelled else job_pb2.JOB_STATE_RUNNING
        return coordinator_pb2.GetJobResponse(job=job_pb2.Job(job_id=request.job_id, state=state))

    def SubmitJob(self, request, context):
        with self.lock:
            self.submitted.append(request.request_id)
        self._enter("SubmitJob", context)
        if not request.spec.name:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "spec.name: required")
        return coordinator_pb2.SubmitJobResponse(job=job_pb2.Job(job_id="job-000001"))

    def CancelJob(self, request, context):
        self._enter("CancelJob", context)
        if self.cancelled:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "job 'job-000001' already ended (cancelled)")
        self.cancelled = True
        time.sleep(self.cancel_sleep)  # the answer is lost when this outlasts the deadline
        return coordinator_pb2.CancelJobResponse(
            job=job_pb2.Job(job_id=request.job_id, state=job_pb2.JOB_STATE_CANCELLED))

    def WatchJob(self, request, context):
        self._enter("WatchJob", context)
        if request.job_id != "job-000001":
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job '{request.job_id}'")
        with self.lock:
            self.watch_requests.append(request.from_sequence)
            call = len(self.watch_requests)
        sent = 0
        for seq in range(max(request.from_sequence, 1), self.events + 1):
            if call in self.drop_after and sent == self.drop_after[call]:
                context.abort(grpc.StatusCode.UNAVAILABLE, "scripted drop")
            if call in self.stall_after and sent == self.stall_after[call]:
                while context.is_active():
                    time.sleep(0.01)
                return
            if seq == self.skip:
                continue
            yield event(seq, final=seq == self.events)
            sent += 1

    def ListWorkers(self, request, context):
        """Workers worker-0 .. worker-4 in pages of two, as the coordinator
        pages them ("after:ID")."""
        self._enter("ListWorkers", context)
        ids = [f"worker-{i}" for i in range(5)]
        after = request.page_token[len("after:"):] if request.page_token else ""
        rest = [i for i in ids if i > after]
        page = rest[:2]
        resp = coordinator_pb2.ListWorkersResponse()
        for i in page:
            resp.workers.add().info.worker_id = i
        if len(rest) > 2:
            resp.next_page_token = "after:" + page[-1]
        return resp

    def UploadModel(self, request_iterator, context):
        self._enter("UploadModel", context)
        for req in request_iterator:
            self.chunks.append((req.chunk.file, req.chunk.offset, len(req.chunk.data)))
        return coordinator_pb2.UploadModelResponse(upload_id="upload-000001")


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.fake = FakeCoordinator()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
        coordinator_pb2_grpc.add_CoordinatorServiceServicer_to_server(self.fake, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.client = cc.ColodClient(f"127.0.0.1:{port}", token="t0ken", timeout=2.0, retry=FAST)

    def tearDown(self):
        self.client.close()
        self.server.stop(grace=None)

    def sequences(self, watch):
        return [e.sequence for e in watch]

    def test_watch_resumes_after_a_dropped_stream(self):
        self.fake.drop_after = {1: 3, 2: 4}
        watch = self.client.watch_job("job-000001", call_timeout=5, total_timeout=10)
        self.assertEqual(self.sequences(watch), list(range(1, 11)))
        self.assertEqual(self.fake.watch_requests, [1, 4, 8])
        self.assertEqual(watch.reconnects, 2)
        self.assertEqual(watch.final_event.sequence, 10)

    def test_watch_resumes_after_its_call_deadline(self):
        self.fake.stall_after = {1: 5}
        watch = self.client.watch_job("job-000001", call_timeout=0.5, total_timeout=10)
        self.assertEqual(self.sequences(watch), list(range(1, 11)))
        # [1, 6], unless a loaded machine did not deliver 5 events in 0.5 s.
        self.assertEqual(len(self.fake.watch_requests), 2)
        self.assertEqual(watch.reconnects, 1)

    def test_watch_from_a_sequence(self):
        self.assertEqual(self.sequences(self.client.watch_job("job-000001", from_sequence=7)), [7, 8, 9, 10])
        past_the_end = self.client.watch_job("job-000001", from_sequence=11)
        self.assertEqual(self.sequences(past_the_end), [])
        self.assertIsNone(past_the_end.final_event)

    def test_watch_reports_a_gap(self):
        self.fake.skip = 4
        with self.assertRaises(cc.WatchOrderError):
            self.sequences(self.client.watch_job("job-000001"))

    def test_watch_gives_up_after_its_total_timeout(self):
        self.fake.stall_after = {call: 2 if call == 1 else 0 for call in range(1, 1000)}
        start = time.monotonic()
        with self.assertRaises(cc.ColodError) as e:
            self.sequences(self.client.watch_job("job-000001", call_timeout=0.2, total_timeout=0.7))
        self.assertEqual(e.exception.code, grpc.StatusCode.DEADLINE_EXCEEDED)
        self.assertLess(time.monotonic() - start, 3)

    def test_watch_does_not_retry_not_found(self):
        with self.assertRaises(cc.ColodError) as e:
            self.sequences(self.client.watch_job("job-000404"))
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(self.fake.calls["WatchJob"], 1)

    def test_unavailable_is_retried_with_the_token(self):
        self.fake.unavailable = {"GetJob": 2}
        self.assertEqual(self.client.get_job("job-000001").job_id, "job-000001")
        self.assertEqual(self.fake.calls["GetJob"], 3)
        self.assertTrue(all(m.get("authorization") == "Bearer t0ken" for m in self.fake.metadata))

    def test_retries_give_up(self):
        self.fake.unavailable = {"GetJob": 10}
        with self.assertRaises(cc.ColodError) as e:
            self.client.get_job("job-000001")
        self.assertEqual(e.exception.code, grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(self.fake.calls["GetJob"], FAST.max_attempts)

    def test_not_found_is_not_retried(self):
        with self.assertRaises(cc.ColodError) as e:
            self.client.get_job("job-000404")
        self.assertEqual(e.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(self.fake.calls["GetJob"], 1)

    def test_submit_retries_with_one_request_id(self):
        self.fake.unavailable = {"SubmitJob": 2}
        self.client.submit_job(job_pb2.JobSpec(name="x"))
        self.assertEqual(len(self.fake.submitted), 3)
        self.assertEqual(len(set(self.fake.submitted)), 1)
        self.assertTrue(self.fake.submitted[0].startswith("py-"))
        self.client.submit_job(job_pb2.JobSpec(name="x"), request_id="mine")
        self.assertEqual(self.fake.submitted[-1], "mine")

    def test_invalid_argument_is_not_retried(self):
        with self.assertRaises(cc.ColodError) as e:
            self.client.submit_job(job_pb2.JobSpec())
        self.assertEqual(e.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(self.fake.calls["SubmitJob"], 1)

    def test_cancel_whose_answer_was_lost(self):
        self.fake.cancel_sleep = 0.5
        client = cc.ColodClient(self.client.address, timeout=0.2, retry=FAST)
        job = client.cancel_job("job-000001", "why")
        client.close()
        self.assertEqual(job.state, job_pb2.JOB_STATE_CANCELLED)
        self.assertGreaterEqual(self.fake.calls["CancelJob"], 2)

    def test_second_cancel_is_failed_precondition(self):
        self.client.cancel_job("job-000001")
        with self.assertRaises(cc.ColodError) as e:
            self.client.cancel_job("job-000001")
        self.assertEqual(e.exception.code, grpc.StatusCode.FAILED_PRECONDITION)

    def test_upload_sends_each_file_in_order(self):
        with tempfile.TemporaryDirectory() as d:
            for name, size in [("config.json", 10), ("model.safetensors", 2500), ("empty.safetensors", 0),
                               ("README.md", 5)]:
                with open(os.path.join(d, name), "wb") as f:
                    f.write(b"x" * size)
            self.assertEqual(self.client.upload_model(d, chunk_bytes=1000).upload_id, "upload-000001")
        self.assertEqual(self.fake.chunks, [("config.json", 0, 10), ("empty.safetensors", 0, 0),
                                            ("model.safetensors", 0, 1000), ("model.safetensors", 1000, 1000),
                                            ("model.safetensors", 2000, 500)])

    def test_list_workers_follows_every_page(self):
        self.fake.unavailable["ListWorkers"] = 1  # a page retried
        workers = self.client.list_workers()
        self.assertEqual([w.info.worker_id for w in workers], [f"worker-{i}" for i in range(5)])
        self.assertEqual(self.fake.calls["ListWorkers"], 4)

    def test_expected_groups(self):
        self.assertEqual(cc.expected_groups(2, 2),
                         {("tp", 0): [0, 1], ("tp", 1): [2, 3], ("dp", 0): [0, 2], ("dp", 1): [1, 3]})
        self.assertEqual(cc.expected_groups(4, 2)[("dp", 1)], [1, 5])


if __name__ == "__main__":
    unittest.main(verbosity=2)
