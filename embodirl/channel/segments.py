"""Named shared-memory segments that never outlive the run, whatever ends it.

Every segment (and FIFO) embodirl puts in ``/dev/shm`` is named ``erl_<run>_<pid>_<serial>...``:
``<run>`` identifies the training run (the driver sets it, workers inherit it through the
``EMBODIRL_SHM_RUN`` environment variable) and ``<pid>`` the process that created it. Cleanup happens
in three layers so that a crash, Ctrl-C or SIGKILL leaves nothing behind:

1. the owner unlinks its segments when it closes them, at interpreter exit (``atexit``) and on
   SIGTERM (SIGINT becomes ``KeyboardInterrupt`` and reaches ``atexit`` through normal unwinding);
2. with its first segment, each owning process starts a *janitor*: a tiny Python process in its own
   session (so Ctrl-C to the terminal's process group does not reach it), and not its child (so
   Ray, which kills an exiting worker's children, does not take it along), that waits on a pidfd for
   its owner to exit, SIGKILL included, and then unlinks ``erl_<run>_<pid>_*``;
3. the run's driver (:func:`own_run`) gets a janitor for the whole ``erl_<run>_*`` prefix and can
   :func:`sweep` a dead worker's segments when it replaces the worker.

Segments are POSIX shared-memory objects opened with the same primitive as
:class:`multiprocessing.shared_memory.SharedMemory` (``shm_open`` + ``mmap``), but without its
resource-tracker registration: before Python 3.13 that registration starts a tracker process in every
process that touches a segment and unlinks segments a *consumer* merely attached when the consumer
exits (bpo-38119). The layers above own cleanup instead.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import mmap
import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

try:
    import _posixshmem  # the module multiprocessing.shared_memory.SharedMemory uses on POSIX
except ImportError:  # pragma: no cover - Windows
    _posixshmem = None

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
RUN_ENV = "EMBODIRL_SHM_RUN"
NAME_ROOT = "erl_"

# re-entrant: the SIGTERM handler runs on the main thread, possibly while that thread holds the lock
_lock = threading.RLock()
_owned: dict[str, Segment | None] = {}   # owned name -> mapped segment (None: a FIFO, or being created)
_serial = itertools.count()
_janitor_for: set[tuple[int, str]] = set()     # (watched pid, pattern) janitors this process started
_hooks_pid: int | None = None                  # pid that installed atexit/signal hooks (fork safety)

# The janitor: waits for a process to exit, then unlinks every /dev/shm entry starting with a prefix.
# It prints one line once it is watching so that the owner never creates a segment it would miss.
# It forks once and lets its parent exit, so it is not the owner's child: Ray kills a worker's
# children when the worker exits, which would take the janitor with it before it could clean up.
_JANITOR_CODE = r"""
import os, select, sys, time
if os.fork():
    os._exit(0)
pid, prefix, shm_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
def alive():
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
try:
    fd = os.pidfd_open(pid)
except ProcessLookupError:
    fd = None
except (AttributeError, OSError):
    fd = -1
sys.stdout.write("watching\n"); sys.stdout.flush(); sys.stdout.close()
if fd is not None and fd >= 0:
    poller = select.poll()   # poll, not select: no limit on the descriptor's number
    poller.register(fd, select.POLLIN)
    poller.poll()
elif fd == -1:
    while alive():
        time.sleep(0.2)
for name in os.listdir(shm_dir):
    if name.startswith(prefix):
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:
            pass
"""


class Segment:
    """A mapped POSIX shared-memory object: ``name`` (no leading slash), ``size`` and ``buf`` (a
    memoryview). :meth:`close` unmaps it (it fails while numpy views into ``buf`` exist)."""

    def __init__(self, name: str, *, create: bool = False, size: int = 0):
        if _posixshmem is None:  # pragma: no cover
            raise OSError("POSIX shared memory is not available on this platform")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open("/" + name, flags, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
                # Reserve the pages now: a tmpfs that is too small (Docker's default 64 MB /dev/shm)
                # then fails here with ENOSPC instead of killing the process with SIGBUS on a write.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)
            self.size = os.fstat(fd).st_size
            self._mmap: mmap.mmap | None = mmap.mmap(fd, self.size)     # None once closed
        except BaseException:
            if create:
                _unlink(name)
            raise
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        if self._mmap is None:
            return
        self.buf.release()       # BufferError while numpy views into it exist
        self._mmap.close()
        self._mmap = None


def run_id() -> str:
    """This run's id (inherited through ``EMBODIRL_SHM_RUN``; created on first use otherwise)."""
    rid = os.environ.get(RUN_ENV)
    if not rid:
        rid = secrets.token_hex(4)
        os.environ[RUN_ENV] = rid
    return rid


def run_prefix(rid: str | None = None) -> str:
    """``erl_<run>_``: every entry of the run starts with it."""
    return f"{NAME_ROOT}{rid or run_id()}_"


def process_prefix(pid: int | None = None, rid: str | None = None) -> str:
    """``erl_<run>_<pid>_``: the entries one process created."""
    return f"{run_prefix(rid)}{pid or os.getpid()}_"


def own_run(rid: str | None = None) -> str:
    """Make this process the run's owner: set the run id (inherited by child processes and passed to
    Ray workers) and start a janitor that removes ``erl_<run>_*`` when this process exits, however it
    exits. Returns the run id."""
    rid = rid or os.environ.get(RUN_ENV) or secrets.token_hex(4)
    os.environ[RUN_ENV] = rid
    _install_hooks()
    _start_janitor(os.getpid(), run_prefix(rid))
    return rid


def new_name(tag: str) -> str:
    """A fresh name owned by this process: ``erl_<run>_<pid>_<serial>_<tag>``."""
    safe = "".join(c if c.isalnum() else "-" for c in tag)[:24]
    return f"{process_prefix()}{next(_serial)}_{safe}"


def create(size: int, tag: str = "seg") -> Segment:
    """Create a segment of ``size`` bytes owned by this process (cleaned up by the layers above)."""
    _install_hooks()
    _start_janitor(os.getpid(), process_prefix())
    name = new_name(tag)
    with _lock:
        _owned[name] = None       # owned from before it exists: a signal in between still removes it
    try:
        segment = Segment(name, create=True, size=max(int(size), 1))
    except BaseException:
        release(name)
        raise
    with _lock:
        _owned[name] = segment
    return segment


def create_fifo(tag: str = "fifo") -> Path:
    """Create a named FIFO in ``/dev/shm`` owned by this process (same cleanup as segments)."""
    _install_hooks()
    _start_janitor(os.getpid(), process_prefix())
    name = new_name(tag)
    path = SHM_DIR / name
    os.mkfifo(path, 0o600)
    with _lock:
        _owned[name] = None
    return path


def attach(name: str) -> Segment:
    """Map an existing segment without taking any responsibility for unlinking it."""
    return Segment(name)


def release(name: str) -> None:
    """Close and unlink an owned segment or FIFO (idempotent)."""
    with _lock:
        obj = _owned.pop(name, None)
    if obj is not None:
        try:
            obj.close()
        except BufferError:  # a numpy view still points into it; the mapping goes with the process
            log.debug("segment %s still has exported views; unlinking without unmapping", name)
    _unlink(name)


def owned() -> list[str]:
    with _lock:
        return sorted(_owned)


def sweep(prefix: str | None = None) -> list[str]:
    """Unlink every ``/dev/shm`` entry starting with ``prefix`` (default: this run's prefix) and return
    the names removed. The driver calls it with :func:`process_prefix` of a worker it replaced."""
    prefix = prefix or run_prefix()
    if not prefix.startswith(NAME_ROOT):
        raise ValueError(f"refusing to sweep '{prefix}': embodirl prefixes start with '{NAME_ROOT}'")
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:  # not Linux: only what this process owns can be found
        names = owned()
    for name in names:
        if name.startswith(prefix):
            if _unlink(name):
                removed.append(name)
    with _lock:
        for name in removed:
            _owned.pop(name, None)
    return removed


def listing(prefix: str = NAME_ROOT) -> list[str]:
    """``/dev/shm`` entries starting with ``prefix`` (tests and the benchmark use it)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


# --- internals ------------------------------------------------------------------------------------
def _unlink(name: str) -> bool:
    try:
        os.unlink(SHM_DIR / name)
        return True
    except FileNotFoundError:
        return False
    except OSError:
        if _posixshmem is None:  # pragma: no cover
            return False
        try:  # not Linux (no /dev/shm): go through the POSIX call
            _posixshmem.shm_unlink("/" + name)
            return True
        except OSError:
            return False


def _release_all() -> None:
    for name in owned():
        release(name)


#: seconds after which a SIGTERM that arrived inside a finalizer is delivered again (see :func:`_on_sigterm`)
REDELIVER_S = 0.05


def _in_finalizer(frame) -> bool:
    """Whether ``frame`` runs inside an object's ``__del__`` or a ``weakref.finalize`` callback, where Python swallows
    any exception (printing "Exception ignored in ..." with its traceback)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_name == "__call__" and code.co_filename.endswith("weakref.py")):
            return True
        frame = frame.f_back
    return False


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through a subprocess in tests
    _release_all()
    previous = _previous_sigterm
    if callable(previous):
        # A handler that stops the process by raising (Ray's workers raise SystemExit) would have its exception
        # swallowed inside a finalizer: the process would print a traceback and go on running. In a Ray worker that
        # is likely, since its main thread waits in Ray's C++ task loop and the first Python code it runs after the
        # signal is often an object's __del__. There the signal is delivered again a moment later instead.
        if _in_finalizer(frame):
            threading.Timer(REDELIVER_S, os.kill, (os.getpid(), signum)).start()
            return
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_previous_sigterm = None


def _forget_after_fork() -> None:
    # A forked child must not unlink its parent's segments at its own exit (and must not inherit a
    # lock another thread of the parent held at the fork).
    global _lock
    _lock = threading.RLock()
    _owned.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def _install_hooks() -> None:
    """atexit and SIGTERM hooks, once per process (again in a forked child)."""
    global _hooks_pid, _previous_sigterm
    if _hooks_pid == os.getpid():
        return
    _hooks_pid = os.getpid()
    atexit.register(_release_all)
    if threading.current_thread() is threading.main_thread():
        try:
            previous = signal.getsignal(signal.SIGTERM)
            if previous is not _on_sigterm:
                _previous_sigterm = previous
                signal.signal(signal.SIGTERM, _on_sigterm)
        except ValueError:  # not allowed here (embedded interpreter)
            pass


def keep_sigterm_hook() -> None:
    """Put this process's SIGTERM hook back on top after a library replaced it (``ray.init`` installs a handler of its
    own that exits without calling the one before): the hook releases the segments, then calls the replacing
    handler. Nothing happens where no hook is installed, or off the main thread."""
    global _previous_sigterm
    if _hooks_pid != os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if current is not _on_sigterm:
        _previous_sigterm = current
        signal.signal(signal.SIGTERM, _on_sigterm)


def _start_janitor(pid: int, prefix: str) -> None:
    key = (pid, prefix)
    if key in _janitor_for and os.getpid() == pid:
        return
    if not SHM_DIR.is_dir():  # not Linux: only layers 1 and 3
        return
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", "-c", _JANITOR_CODE, str(pid), prefix, str(SHM_DIR)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )
    line = proc.stdout.readline() if proc.stdout else b""
    if proc.stdout:
        proc.stdout.close()
    if line.strip() != b"watching":
        log.warning("shared-memory janitor for %s did not start; relying on atexit cleanup", prefix)
    proc.wait()   # the launcher exits at once; the janitor itself lives on as nobody's child here
    _janitor_for.add(key)
