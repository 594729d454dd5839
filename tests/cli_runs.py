"""``embodirl`` command runs for the tests: ``run(args, cwd)`` is ``subprocess.run([python, -m, embodirl.cli, *args])``
with its output captured, its exit status and its timeout, started from a process that has already imported what
every run imports.

Why: the suite starts ~160 ``embodirl`` processes, and each spent 1.4-5 CPU-s importing torch, tensordict, Hydra,
the policies and ManiSkill before its first line of work; on two cores the suite is CPU-bound (both 95-100 % busy in
every minute of its run). With the zygote, a clean clone's suite took 2551 CPU-s in its tests instead of 2947, and pytest
1401 s instead of 1584 (2026-12-01, the project's 2-core machine, one run each). A *zygote* per pytest
worker (``python tests/cli_runs.py``, started with that worker's environment) imports them once and forks a child
per run. The child is what a fresh ``python -m embodirl.cli`` is from ``main()`` on: its own process with the
test's argv, working directory, environment and standard streams (the caller's files, passed over a Unix socket),
fresh random seeds, the signal dispositions a subprocess of the test gets, and the interpreter's normal exit
(atexit handlers, flushed streams, a traceback and status 1 for an uncaught exception). Multiprocessing's
forkserver, which the simulators use, forks from a preloaded process the same way.

What a fork cannot give a run, a real process does: a run whose environment differs from the zygote's (beyond
``PYTEST_CURRENT_TEST``) is started as a subprocess, since libraries read some variables once at import
(``OMP_NUM_THREADS``, ``EMBODIRL_PROGRESS_INTERVAL_S``, the Vulkan loader's); so is every run when
``EMBODIRL_TEST_FORK=0``. Tests that watch, signal or kill a running job get ``start(args, cwd)``, a handle with
what they use of ``subprocess.Popen`` (``pid``, ``stdout``, ``poll``, ``wait``, ``communicate``, ``send_signal``,
``kill``), optionally in a session of its own as ``start_new_session=True`` gives. Tests about the process itself
(import time, the clock that counts from the process start) call ``subprocess`` directly.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

EXE = [sys.executable, "-m", "embodirl.cli"]
#: what the zygote imports before its first fork: the config stack (it pulls torch), the commands' modules, the
#: policies (transformers, peft) and what the simulators' own forkserver preloads (the Vulkan set-up, ManiSkill's
#: task registry, which validation reads); measured per run: 1.4 CPU-s saved for a refusal, ~3 for a toy run
PRELOAD = ("embodirl.config", "embodirl.tools.doctor", "embodirl.runner.loop", "embodirl.sft.cli", "embodirl.demos.generate",
           "tensordict", "hydra.main", "embodirl.models.openvla_oft.policy", "embodirl.models.pi0.policy", "peft",
           "embodirl.envs.maniskill.preload")
#: variables a run may set differently from the zygote without a real process (nothing reads them at import)
_FREE_VARS = frozenset({"PYTEST_CURRENT_TEST", "EMBODIRL_SHM_RUN"})   # the second: the run's shared-memory id
_LOCK = threading.Lock()
_zygote: _Zygote | None = None


def run(args: list[str], cwd, *, env: dict[str, str] | None = None, timeout: float = 600,
        expect: int | None = None) -> subprocess.CompletedProcess:
    """``embodirl <args>`` in ``cwd`` with ``env`` (default: this process's), text output captured. ``expect``: the
    exit status to assert, with the output's tail in the message."""
    env = dict(os.environ if env is None else env)
    zygote = _get_zygote()
    if zygote is not None and zygote.serves(env):
        proc = zygote.run([*EXE, *args], str(cwd), env, timeout)
    else:
        proc = subprocess.run([*EXE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if expect is not None:
        assert proc.returncode == expect, (proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


def start(args: list[str], cwd, *, env: dict[str, str] | None = None, new_session: bool = False,
          default_sigint: bool = False):
    """``subprocess.Popen([python, -m, embodirl.cli, *args], stdout=PIPE, stderr=STDOUT, text=True)`` in ``cwd`` with
    ``env``: a running job to watch, signal or kill. ``new_session``: as ``start_new_session=True`` (the job is its
    session's leader, so its session id is its pid). ``default_sigint``: Ctrl-C interrupts the job even when this
    process was started with SIGINT ignored (a shell's background job), as a terminal's Ctrl-C finds it."""
    env = dict(os.environ if env is None else env)
    zygote = _get_zygote()
    if zygote is not None and zygote.serves(env):
        return _Started(zygote.path, [*EXE, *args], str(cwd), env, new_session, default_sigint)
    reset = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if default_sigint else None
    return subprocess.Popen([*EXE, *args], cwd=cwd, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=new_session, preexec_fn=reset)


def _get_zygote() -> _Zygote | None:
    """This process's zygote, started again when this process's own environment has changed since (a library of
    the test process sets a variable, such as torch's inductor its cache directory): runs that pass an environment
    of their own get a real process instead (:meth:`_Zygote.serves`)."""
    global _zygote
    if os.environ.get("EMBODIRL_TEST_FORK", "1") == "0":
        return None
    with _LOCK:
        if _zygote is None or not _zygote.alive() or not _zygote.serves(dict(os.environ)):
            if _zygote is not None:
                _zygote.close()
            _zygote = _Zygote()
        return _zygote


def _text(raw: bytes) -> str:
    """Bytes as ``subprocess.run(text=True)`` decodes them (the locale's encoding, universal newlines)."""
    return io.TextIOWrapper(io.BytesIO(raw)).read()


class _Zygote:
    """The client side: starts the server, sends it one request per run."""

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="embodirl-zygote-")
        self.path = os.path.join(self._dir, "sock")
        self.env = dict(os.environ)
        # stdin is a pipe the server watches: when this process ends, it ends too
        atexit.register(shutil.rmtree, self._dir, ignore_errors=True)
        self.proc = subprocess.Popen([sys.executable, __file__, self.path], stdin=subprocess.PIPE, env=self.env,
                                     cwd=self._dir)
        atexit.register(self.close)   # before the folder goes (atexit runs last-registered first)
        ready = os.path.join(self._dir, "ready")
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"the CLI zygote exited with status {self.proc.returncode} before it was ready")
            select.select([], [], [], 0.05)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """End the server (its stdin closes); runs it forked go on to their end."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)

    def serves(self, env: dict[str, str]) -> bool:
        keys = (self.env.keys() | env.keys()) - _FREE_VARS
        return all(self.env.get(k) == env.get(k) for k in keys)

    def run(self, argv: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, open(os.devnull, "rb") as null, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.path)
            request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode() + b"\n"
            socket.send_fds(conn, [request], [null.fileno(), out.fileno(), err.fileno()])
            reader = conn.makefile("r")
            pid = json.loads(reader.readline())["pid"]
            conn.settimeout(timeout)
            try:
                line = reader.readline()
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)   # as subprocess.run does on a timeout: the child itself
                out.seek(0), err.seek(0)
                raise subprocess.TimeoutExpired(argv, timeout, out.read(), err.read()) from None
            if not line:
                raise RuntimeError(f"the CLI zygote ended before the run {pid} did: {argv}")
            out.seek(0), err.seek(0)
            return subprocess.CompletedProcess(argv, json.loads(line)["status"], _text(out.read()), _text(err.read()))


class _Started:
    """A forked run that goes on while the test watches it: the subset of ``subprocess.Popen`` the tests use. Its
    standard output and error are one pipe (``stdout``, text); its exit status comes from the zygote (its parent) over
    the request's connection, as a signal's negative number when a signal ended it."""

    def __init__(self, path: str, argv: list[str], cwd: str, env: dict[str, str], new_session: bool,
                 default_sigint: bool):
        self.args, self.returncode = argv, None
        read_end, write_end = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(path)
        request = {"argv": argv, "cwd": cwd, "env": env, "setsid": new_session, "sigint": default_sigint}
        with open(os.devnull, "rb") as null:
            socket.send_fds(self._conn, [json.dumps(request).encode() + b"\n"], [null.fileno(), write_end, write_end])
        os.close(write_end)    # the child and what it starts hold the pipe now: end of file when all of them are gone
        self.stdout = open(read_end, encoding=None)      # text, the locale's encoding, as Popen(text=True)
        self._lines = self._output = b""
        self.pid = json.loads(self._message(None))["pid"]

    def _message(self, timeout: float | None) -> str:
        """The zygote's next line: the child's pid, then its exit status."""
        while b"\n" not in self._lines:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the CLI zygote ended before the run {getattr(self, 'pid', '?')} did: {self.args}")
            self._lines += chunk
        line, self._lines = self._lines.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = json.loads(self._message(timeout))["status"]
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """The output (standard error in it) once every writer is gone, then the exit status. After a timeout, a
        later call returns everything, what the first one had read included."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.stdout.fileno()
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout, _text(self._output))
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            self._output += chunk
        self.stdout.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return _text(self._output), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


# --- the server: runs as a script (python tests/cli_runs.py SOCKET) ----------------------------------------------------

def _serve(path: str) -> dict:
    """Accept requests until this process's stdin closes; fork a child per request. Returns only in a child, with
    its request (the parent never returns)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    # a child's exit wakes the loop: SIGCHLD writes a byte to this pipe (no polling on the suite's two cores)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    Path(path).with_name("ready").touch()
    waiting: dict[int, socket.socket] = {}   # child pid -> the connection its status goes back on
    while True:
        readable, _, _ = select.select([listener, sys.stdin, wake_r], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):
            os._exit(0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        if listener in readable:
            conn, _ = listener.accept()
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while not data.endswith(b"\n"):
                data += conn.recv(1 << 16)
            sys.stdout.flush(), sys.stderr.flush()
            request = json.loads(data)
            started_r, started_w = os.pipe()   # the child's own set-up is done before its pid goes back (as Popen's)
            pid = os.fork()
            if pid == 0:
                if request.get("setsid"):
                    os.setsid()
                os.close(started_r), os.close(started_w)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_r), os.close(wake_w)
                listener.close()
                for other in waiting.values():
                    other.close()
                conn.close()
                for target, fd in enumerate(fds):   # sys.stdin/stdout/stderr read and write these descriptors
                    os.dup2(fd, target)
                    os.close(fd)
                return request
            os.close(started_w)
            os.read(started_r, 1)              # end of file once the child has closed its end
            os.close(started_r)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            waiting[pid] = conn
        for pid in list(waiting):
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                conn = waiting.pop(pid)
                status = -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass   # the caller gave up (timeout)
                conn.close()


def _child(request: dict) -> None:
    """Become ``python -m embodirl.cli <args>`` in the request's directory and environment."""
    import random
    import runpy

    import numpy as np
    import torch

    if request.get("sigint"):
        signal.signal(signal.SIGINT, signal.default_int_handler)   # what Python installs when it starts
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = os.getcwd()           # `python -m` puts the working directory first
    random.seed()                       # a fresh process draws its own seeds (torch too, since 2.x)
    np.random.seed()
    torch.seed()
    sys.argv = ["-m", *request["argv"][3:]]   # run_module puts the module's file first, as `python -m` does
    runpy.run_module("embodirl.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import gc
    import importlib

    sys.path[0] = os.getcwd()    # not tests/: a run's imports see what `python -m` in a scratch directory sees
    for name in PRELOAD:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()                 # the children's collections skip the preloaded objects: no copy of their pages
    _child(_serve(sys.argv[1]))
