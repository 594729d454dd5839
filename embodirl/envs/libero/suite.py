"""The static facts of a LIBERO suite (tasks, BDDL files, init states in the package's order) and the
task / init-state schedule an env config names; no simulator is built here."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodirl.envs.libero import paths as libero_paths

log = logging.getLogger(__name__)

# task count per suite (libero/libero/benchmark/libero_suite_task_map.py; a test checks it)
SUITE_NUM_TASKS = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}


@dataclass(frozen=True)
class SuiteInfo:
    """Tasks of one LIBERO suite in the package's order (task order 0, as OFT uses)."""

    name: str
    descriptions: list[str]
    bddl_files: list[Path]
    num_init_states: list[int]
    benchmark: object               # libero.libero.benchmark.Benchmark

    def init_states(self, task_id: int) -> np.ndarray:
        """float64 ``[K, D]`` flattened MuJoCo states (time, qpos, qvel) of task ``task_id``."""
        return np.asarray(self.benchmark.get_task_init_states(task_id))


@functools.cache
def _suite_info(suite: str, assets: str) -> SuiteInfo:
    libero = libero_paths.prepare(assets)
    with contextlib.redirect_stdout(io.StringIO()) as printed:   # the package prints its task order
        from libero.libero import benchmark

        bench = benchmark.get_benchmark_dict()[suite]()
    if printed.getvalue().strip():
        log.debug("libero: %s", printed.getvalue().strip())
    bddl_root = Path(libero.get_libero_path("bddl_files"))
    tasks = [bench.get_task(i) for i in range(bench.get_num_tasks())]
    return SuiteInfo(
        name=suite,
        descriptions=[task.language for task in tasks],
        bddl_files=[bddl_root / task.problem_folder / task.bddl_file for task in tasks],
        num_init_states=[len(bench.get_task_init_states(i)) for i in range(len(tasks))],
        benchmark=bench,
    )


def suite_info(env) -> SuiteInfo:
    """The suite an env group (the typed ``LiberoEnvConfig``, :mod:`.simulator`) names (assets resolved as
    :mod:`libero_paths` says)."""
    assets = libero_paths.resolve_assets_dir(env.assets_path)
    return _suite_info(env.suite, str(assets))


def task_pool(env) -> list[int]:
    """Task ids the env group uses (``task_ids``; null = the whole suite)."""
    return list(env.task_ids) if env.task_ids is not None else list(range(SUITE_NUM_TASKS[env.suite]))


def eval_schedule(env) -> list[tuple[int, int]]:
    """The evaluation sweep as ordered ``(task_id, init_state_id)`` pairs: for every task of the pool,
    trial k uses init state k (``num_trials_per_task`` trials), or the listed ``init_state_ids``."""
    explicit = env.init_state_ids
    trials = list(explicit) if explicit is not None else list(range(env.num_trials_per_task))
    return [(task, init) for task in task_pool(env) for init in trials]
