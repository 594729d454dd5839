"""The static facts of a LIBERO env split's tasks (descriptions, BDDL files, init states in the package's order; a
suite's, or a suite's LIBERO-PRO perturbations', :mod:`.pro`) and the task / init-state schedule an env config names;
no simulator is built here."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodirl.envs.libero import paths as libero_paths
from embodirl.envs.libero import pro

log = logging.getLogger(__name__)

# task count per suite (libero/libero/benchmark/libero_suite_task_map.py; a test checks it)
SUITE_NUM_TASKS = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}


@dataclass(frozen=True)
class SuiteInfo:
    """The task table of one LIBERO env split: a suite's tasks in the package's order (task order 0, as OFT uses),
    or, with ``perturbations``, the base suite's tasks once per entry (:mod:`.pro`), entry-major: task id
    ``g = i * n + t`` is task ``t`` of the ``i``-th entry's suite (``n`` tasks per suite)."""

    name: str                       # the base suite (a checkpoint's action statistics are kept under it)
    descriptions: list[str]
    bddl_files: list[Path]
    num_init_states: list[int]
    groups: list[str]               # per task id: the suite it comes from (libero_spatial, libero_spatial_lan, ...)
    loaders: tuple = ()             # per task id: () -> its init states; not compared

    def init_states(self, task_id: int) -> np.ndarray:
        """float64 ``[K, D]`` flattened MuJoCo states (time, qpos, qvel) of task ``task_id``."""
        return np.asarray(self.loaders[task_id]())


def _official_tasks(libero, suite: str) -> tuple[list[str], list[Path], list]:
    """Descriptions, BDDL files and init-state loaders of a suite as libero 0.1.1's benchmark lists them (``libero``:
    the prepared ``libero.libero`` module)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:   # the package prints its task order
        from libero.libero import benchmark

        bench = benchmark.get_benchmark_dict()[suite]()
    if printed.getvalue().strip():
        log.debug("libero: %s", printed.getvalue().strip())
    bddl_root = Path(libero.get_libero_path("bddl_files"))
    tasks = [bench.get_task(i) for i in range(bench.get_num_tasks())]
    loaders = [functools.partial(bench.get_task_init_states, i) for i in range(len(tasks))]
    return ([task.language for task in tasks], [bddl_root / task.problem_folder / task.bddl_file for task in tasks],
            loaders)


def _pro_tasks(suite: str) -> tuple[list[str], list[Path], list]:
    """The same for a LIBERO-PRO suite (its instruction is the BDDL file's: :mod:`.pro`)."""
    names = pro.task_names(suite)
    bddls = [pro.bddl_file(suite, name) for name in names]
    return ([pro.instruction(b) for b in bddls], bddls,
            [functools.partial(pro.init_states, suite, name) for name in names])


@functools.cache
def _suite_info(suite: str, perturbations: tuple[str, ...] | None, assets: str) -> SuiteInfo:
    libero = libero_paths.prepare(assets)
    entries = perturbations if perturbations is not None else (pro.ORIGINAL,)
    descriptions, bddl_files, loaders, groups = [], [], [], []
    for entry in entries:
        group = pro.suite_name(suite, entry)
        found = _official_tasks(libero, group) if entry == pro.ORIGINAL else _pro_tasks(group)
        descriptions += found[0]
        bddl_files += found[1]
        loaders += found[2]
        groups += [group] * len(found[0])
    return SuiteInfo(name=suite, descriptions=descriptions, bddl_files=bddl_files,
                     num_init_states=[len(load()) for load in loaders], groups=groups, loaders=tuple(loaders))


def suite_info(env) -> SuiteInfo:
    """The task table an env split (the typed ``LiberoEnvConfig``, :mod:`.simulator`) names (assets resolved as
    :mod:`libero_paths` says)."""
    assets = libero_paths.resolve_assets_dir(env.assets_path)
    perturbations = tuple(env.perturbations) if env.perturbations is not None else None
    return _suite_info(env.suite, perturbations, str(assets))


def placed_types(bddl: Path) -> set[str]:
    """The object and fixture types a task's BDDL file places (its ``name - type`` lines)."""
    text = Path(bddl).read_text()
    types = set()
    for section in ("fixtures", "objects"):
        match = re.search(rf"\(:{section}(.*?)\)", text, re.S)
        if match:
            types |= {line.split(" - ")[1].strip() for line in match.group(1).splitlines() if " - " in line}
    return types


def task_pool(env) -> list[int]:
    """Task ids the env split uses: ``task_ids`` (null = the whole suite), in every entry of ``perturbations``."""
    n = SUITE_NUM_TASKS[env.suite]
    local = list(env.task_ids) if env.task_ids is not None else list(range(n))
    entries = len(env.perturbations) if env.perturbations is not None else 1
    return [i * n + t for i in range(entries) for t in local]


def eval_schedule(env) -> list[tuple[int, int]]:
    """The evaluation sweep as ordered ``(task_id, init_state_id)`` pairs: for every task of the pool,
    trial k uses init state k (``num_trials_per_task`` trials), or the listed ``init_state_ids``."""
    explicit = env.init_state_ids
    trials = list(explicit) if explicit is not None else list(range(env.num_trials_per_task))
    return [(task, init) for task in task_pool(env) for init in trials]
