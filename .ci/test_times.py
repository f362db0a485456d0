#!/usr/bin/env python3
"""Checks one `bazel test` run's times against the tests' timeouts.

Reads the run's Build Event Protocol file (bazel test
--build_event_json_file=FILE): every test attempt's duration (each shard's
on its own: Bazel times shards separately) and its target's timeout, the
limit Bazel itself applies. A test that passed but used more than half of
its timeout is an error: on a slower instance of the machine, or beside a
heavier neighbour, it is the next timeout (docs/TESTING.md). Prints the
slowest tests of the run, then each offender, and exits with the number of
offenders (capped at 100), 0 when none.

Usage: test_times.py [--label NAME] [--max-fraction F] [--show N] BEP_JSON
"""
import argparse
import json
import sys


def read_events(path):
    """The BEP file's events; a truncated last line (a killed run) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def collect(events):
    """Returns ({label: timeout seconds}, [attempts]); an attempt is a dict with
    label, shard, shards, run, attempt, seconds, status, cached."""
    timeouts, attempts, shard_counts = {}, [], {}
    for e in events:
        eid = e.get("id", {})
        if "targetCompleted" in eid:
            timeout = e.get("completed", {}).get("testTimeoutSeconds")
            if timeout is not None:
                timeouts[eid["targetCompleted"]["label"]] = int(timeout)
        elif "testResult" in eid and "testResult" in e:
            key, result = eid["testResult"], e["testResult"]
            label = key["label"]
            shard_counts[label] = max(shard_counts.get(label, 1), int(key.get("shard", 1)))
            attempts.append({
                "label": label,
                "shard": int(key.get("shard", 1)),
                "run": int(key.get("run", 1)),
                "attempt": int(key.get("attempt", 1)),
                "seconds": int(result.get("testAttemptDurationMillis", 0)) / 1000.0,
                "status": result.get("status", "PASSED"),
                "cached": bool(result.get("cachedLocally", False)),
            })
    for a in attempts:
        a["shards"] = shard_counts[a["label"]]
    return timeouts, attempts


def describe(a):
    where = a["label"]
    if a["shards"] > 1:
        where += " (shard %d of %d)" % (a["shard"], a["shards"])
    return where


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bep", help="the run's --build_event_json_file")
    parser.add_argument("--label", default="tests", help="the pass's name, for the report")
    parser.add_argument("--max-fraction", type=float, default=0.5,
                        help="the largest share of its timeout a passing test may use (0.5)")
    parser.add_argument("--show", type=int, default=5, help="how many of the slowest to list (5)")
    args = parser.parse_args(argv)
    if not 0 < args.max_fraction <= 1:
        parser.error("--max-fraction must be in (0, 1]")

    timeouts, attempts = collect(read_events(args.bep))
    # Only attempts that passed: a test that timed out or failed is already a
    # failure of the run, counted there.
    timed = []
    for a in attempts:
        timeout = timeouts.get(a["label"])
        if timeout and a["status"] in ("PASSED", "FLAKY"):
            timed.append((a["seconds"] / timeout, timeout, a))
    timed.sort(key=lambda t: -t[0])

    labels = {a["label"] for _, _, a in timed}
    print("test times (%s): %d tests, %d timed runs; the slowest against their timeouts:"
          % (args.label, len(labels), len(timed)))
    for fraction, timeout, a in timed[:args.show]:
        print("  %7.1f s of %4d s (%3.0f%%)  %s%s" % (a["seconds"], timeout, 100 * fraction, describe(a),
                                                   ", cached" if a["cached"] else ""))
    offenders = [t for t in timed if t[0] > args.max_fraction]
    for fraction, timeout, a in offenders:
        print("TOO SLOW (%s): %s took %.1f s, %.0f%% of its %d s timeout (more than %.0f%%): give it a "
              "larger size or timeout, shard it, or have it do less in this configuration "
              "(docs/TESTING.md)" % (args.label, describe(a), a["seconds"], 100 * fraction, timeout,
                                     100 * args.max_fraction))
    print("test times (%s): %d over %.0f%% of their timeout" % (args.label, len(offenders),
                                                              100 * args.max_fraction))
    return min(len(offenders), 100)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
