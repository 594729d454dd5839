"""``runner.worker_deadline``'s three keys, as the run reads them from its config: a kind of call not timed yet (a first
build, a first checkpoint) waits ``first_call_s``; after it, ``multiple`` x the slowest recent call, never under
``floor_s``; ``floor_s: null`` turns deadlines off. The stuck-worker runs themselves are in
tests/runner/test_hung_workers.py (floor_s) - a first call that hangs would cost first_call_s of the suite's time."""

from __future__ import annotations

from embodirl.config import compose
from embodirl.schema import run_config
from embodirl.workers.deadlines import CallTimes


def _times(*overrides: str) -> CallTimes:
    return CallTimes(run_config(compose(["env=toy_reach", *overrides])).runner.worker_deadline)


def test_a_first_call_waits_first_call_s_then_the_deadline_follows_the_calls():
    times = _times("runner.worker_deadline.first_call_s=900", "runner.worker_deadline.floor_s=60",
                   "runner.worker_deadline.multiple=20")
    assert times.limit("train") == 900 and "first_call_s=900" in times.describe("train")
    times.record("train", 2.0)
    times.record("train", 5.0)
    assert times.limit("train") == 100                  # 20 x the slowest of its recent calls
    times.record("act", 0.1)
    assert times.limit("act") == 60                     # never under the floor
    assert times.limit("export") == 900                 # another kind, not timed yet


def test_a_first_call_never_gets_less_than_the_floor_and_null_turns_deadlines_off():
    assert _times("runner.worker_deadline.first_call_s=5", "runner.worker_deadline.floor_s=60").limit("train") == 60
    off = _times("runner.worker_deadline.floor_s=null")
    assert not off.enabled and off.limit("train") is None
