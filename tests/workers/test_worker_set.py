"""WorkerSet, the one place that tells a worker in this process from a Ray worker: a call names the worker class's
own function (a string or another class's function is refused), a worker's error is raised where the result is
read (as Ray raises it), and the batch calls keep rank order. The same calls on Ray workers, and a dead Ray worker
named by its rank, are in tests/workers/test_groups_ray.py (it shares that file's Ray)."""

from __future__ import annotations

import os

import pytest

from embodirl.workers.worker_set import WorkerSet


class Counter:
    """A worker: state of its own, a method that fails on demand, a close that is recorded."""

    closed: list[int] = []

    def __init__(self, rank: int):
        self.rank, self.total = rank, 0

    def add(self, x: int) -> int:
        self.total += x
        return self.rank * 100 + self.total

    def fail(self, message: str) -> None:
        raise ValueError(f"worker {self.rank}: {message}")

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        Counter.closed.append(self.rank)


class Other:
    def add(self, x: int) -> int:
        return x


def _local(n: int = 3) -> WorkerSet:
    workers = WorkerSet(Counter, remote=False)
    for rank in range(n):
        workers.start(rank, rank)
    return workers


def test_a_call_names_the_worker_class_function_not_a_string():
    workers = _local()
    assert workers.call(1, Counter.add, 5) == 105
    for wrong in ("add", Other.add, Counter(0).add, print):
        with pytest.raises(TypeError, match="pass Counter.<method>"):
            workers.call_async(0, wrong, 1)
    assert workers.call(1, Counter.add, 1) == 106         # nothing ran for the refused calls


def test_an_error_is_raised_where_the_result_is_read_and_order_follows_ranks():
    workers = _local()
    pending = workers.call_async(2, Counter.fail, "boom")      # in this process the call has run, its error is kept
    with pytest.raises(ValueError, match="worker 2: boom"):
        workers.get(pending)
    assert workers.call_all(Counter.add, 1) == [1, 101, 201]
    assert workers.call_each(Counter.add, [10, 20, 30]) == [11, 121, 231]
    assert workers.gather([workers.call_async(r, Counter.add, 0) for r in (2, 0)]) == [231, 11]
    pending = {workers.call_async(r, Counter.add, 0): r for r in range(3)}
    assert pending[workers.wait_first(pending)] == 0       # here: in submission order
    assert workers.share(pending) is pending


def test_start_replaces_a_rank_and_close_closes_every_worker():
    Counter.closed.clear()
    workers = _local()
    workers.call(1, Counter.add, 7)
    workers.start(1, 1)                                    # a replacement starts afresh
    assert workers.call(1, Counter.add, 0) == 100 and len(workers) == 3
    workers.kill(0)
    workers.close()
    assert Counter.closed == [0, 0, 1, 2] and len(workers) == 0
