"""Where a sub-env of :class:`~embodirl.envs.vector.vector_env.ProcessVectorEnv` lives: in the calling process
(:class:`LocalSubEnv`) or in a child process behind a pipe (:class:`ProcessSubEnv`). Both take
``(command, kwargs)`` messages for an :class:`~embodirl.envs.vector.episodes.EpisodeRunner` (``reset``, ``step``)
with ``send`` and answer them with ``recv``; any failure there (an exception in the simulator, a dead
process, a timeout) is raised as :class:`SubEnvFailure`, which the vector env's recovery handles.

Factories are pickled with cloudpickle and called inside the child, so a simulator is built, stepped and
closed in one process. A child exits at the end of its command pipe and, while busy in a step, a watchdog
thread ends it when the owning process is gone (even after a SIGKILL).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_connections
from multiprocessing.process import BaseProcess

import cloudpickle
import psutil

from embodirl.envs.base import SimEnv
from embodirl.envs.vector.episodes import EpisodeRunner

log = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")  # fork breaks EGL/MuJoCo and SAPIEN contexts
CLOSE_TIMEOUT_S = 10.0
OWNER_POLL_S = 1.0               # owner-liveness poll where pidfd_open is unavailable


class SubEnvFailure(Exception):
    """Internal: one sub-env's command failed (exception, death, timeout); carries the cause."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


def _pack_exception(exc: BaseException) -> tuple:
    """An exception as (class, args, attributes, traceback) - rebuilt without calling ``__init__``, so
    exceptions with custom constructors (``ConfigError(key, message)``) cross the pipe intact."""
    payload = (type(exc), exc.args, dict(getattr(exc, "__dict__", {})), traceback.format_exc())
    try:
        pickle.dumps(payload)
    except Exception:  # unpicklable class or attributes: keep the message
        payload = (RuntimeError, (f"{type(exc).__name__}: {exc}",), {}, payload[3])
    return payload


def _unpack_exception(payload: tuple) -> BaseException:
    cls, args, state, remote_tb = payload
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    exc.add_note(f"raised in a simulator sub-process:\n{remote_tb}")
    return exc


def _exit_with_owner(owner_pid: int) -> None:
    """Exit this sub-process as soon as the process that owns the vector env exits, even while a
    simulator step is running (an idle worker also sees the end of its pipe). A thread waits on a
    pidfd of the owner; the kernel's parent-death signal cannot be used because under ``forkserver``
    the parent is the fork server, which lives as long as any of its children."""
    try:
        fd = os.pidfd_open(owner_pid)
    except (AttributeError, OSError):   # kernel < 5.3: poll instead
        fd = None
    if not psutil.pid_exists(owner_pid):
        os._exit(1)

    def watch() -> None:
        if fd is not None:
            poller = select.poll()      # poll, not select: no limit on the descriptor's number
            poller.register(fd, select.POLLIN)
            poller.poll()
        else:
            while psutil.pid_exists(owner_pid):
                time.sleep(OWNER_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="embodirl-owner-watch", daemon=True).start()


def _worker_main(conn, factory_bytes: bytes, runner_kwargs: dict, owner_pid: int) -> None:
    """Sub-process main loop: build the env, then answer ``(command, kwargs)`` messages until
    ``close`` or the end of the pipe."""
    _exit_with_owner(owner_pid)
    from embodirl import runtime

    runtime.configure()   # before the factory imports mujoco / sapien
    # one simulator per process: single-threaded torch (ManiSkill) avoids thread pools spinning
    # against the other simulators on the same cores
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    try:
        runner = EpisodeRunner(cloudpickle.loads(factory_bytes)(), **runner_kwargs)
        conn.send(("ok", runner.spec))
    except BaseException as exc:
        conn.send(("error", _pack_exception(exc)))
        return
    try:
        while True:
            try:
                command, kwargs = conn.recv()
            except (EOFError, OSError):    # parent gone
                break
            if command == "close":
                break
            try:
                conn.send(("ok", getattr(runner, command)(**kwargs)))
            except Exception as exc:
                conn.send(("error", _pack_exception(exc)))
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        try:
            runner.close()
        except Exception:
            pass


class LocalSubEnv:
    """A sub-env in the calling process (``processes=False``): commands run at ``recv``."""

    pid = None

    def __init__(self, factory: Callable[[], SimEnv], runner_kwargs: dict):
        self._factory = factory
        self._runner_kwargs = runner_kwargs
        self._runner: EpisodeRunner | None = None
        self._pending: tuple[str, dict] | None = None

    def start(self) -> None:
        self._pending = ("__build__", {})

    def send(self, command: str, kwargs: dict) -> None:
        self._pending = (command, kwargs)

    def recv(self, timeout: float | None = None):
        assert self._pending is not None, "recv() without a command sent"
        command, kwargs = self._pending
        self._pending = None
        try:
            if command == "__build__":
                self._runner = EpisodeRunner(self._factory(), **self._runner_kwargs)
                return self._runner.spec
            return getattr(self._runner, command)(**kwargs)
        except Exception as exc:
            raise SubEnvFailure(exc) from exc

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        if self._runner is not None:
            try:
                self._runner.close()
            except Exception as exc:
                log.debug("closing sub-env failed: %s", exc)
            self._runner = None

    kill = close


class ProcessSubEnv:
    """A sub-env in its own process, driven over a pipe."""

    def __init__(self, ctx, factory_bytes: bytes, runner_kwargs: dict, name: str):
        self._ctx = ctx
        self._factory_bytes = factory_bytes
        self._runner_kwargs = runner_kwargs
        self._name = name
        self.process: BaseProcess | None = None        # both set by start(), None again after kill()
        self.conn: Connection | None = None
        self._close_requested = False
        self._pending_failure: SubEnvFailure | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        self.process = self._ctx.Process(target=_worker_main, name=self._name, daemon=True,
                                         args=(child_conn, self._factory_bytes, self._runner_kwargs, os.getpid()))
        self.process.start()
        child_conn.close()   # so that the child's death reads as EOF here
        self.conn = parent_conn

    @property
    def name(self) -> str:
        return self._name

    def _started(self) -> tuple[BaseProcess, Connection]:
        assert self.process is not None and self.conn is not None, f"{self._name} is not started"
        return self.process, self.conn

    @property
    def waitables(self) -> list:
        """What :func:`multiprocessing.connection.wait` watches for this sub-env's answer or death."""
        if self._pending_failure is not None:
            return []
        process, conn = self._started()
        return [conn, process.sentinel]

    @property
    def failed_to_send(self) -> bool:
        return self._pending_failure is not None

    def send(self, command: str, kwargs: dict) -> None:
        _, conn = self._started()
        try:
            conn.send((command, kwargs))
        except (BrokenPipeError, OSError) as exc:
            self._pending_failure = SubEnvFailure(ChildProcessError(f"{self._name} is gone ({exc})"))
        else:
            self._pending_failure = None

    def recv(self, timeout: float | None = None):
        if self._pending_failure is not None:
            failure, self._pending_failure = self._pending_failure, None
            raise failure
        process, conn = self._started()
        ready = wait_connections([conn, process.sentinel], timeout)
        if not ready:
            raise SubEnvFailure(TimeoutError(f"{self._name} did not answer within {timeout:g} s"))
        try:
            status, payload = conn.recv()
        except (EOFError, OSError) as exc:
            process.join(1.0)
            raise SubEnvFailure(ChildProcessError(
                f"{self._name} died (exit code {process.exitcode})")) from exc
        if status == "error":
            cause = _unpack_exception(payload)
            raise SubEnvFailure(cause) from cause
        return payload

    def request_close(self) -> None:
        """Ask the sub-process to close its simulator and exit (does not wait)."""
        if self.process is None or self._close_requested:
            return
        self._close_requested = True
        _, conn = self._started()
        try:
            conn.send(("close", {}))
        except (BrokenPipeError, OSError, ValueError):
            pass

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        if self.process is None:
            return
        self.request_close()
        self.process.join(timeout)
        self.kill()

    def kill(self) -> None:
        if self.process is None:
            return
        if self.process.is_alive():
            self.process.kill()     # SIGKILL: a stopped (SIGSTOP) or hung process cannot ignore it
            self.process.join(CLOSE_TIMEOUT_S)
        process, conn = self._started()
        try:
            conn.close()
            process.close()
        except (OSError, ValueError):
            pass
        self.process = None
        self.conn = None
