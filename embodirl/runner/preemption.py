"""Preemption: a signal that the job is about to be stopped ends a training run cleanly, with a checkpoint to
resume from, instead of losing the steps since the last ``runner.save_interval``.

Kubernetes and Slurm send SIGTERM before they kill a job (Kubernetes after ``terminationGracePeriodSeconds``,
Slurm ``KillWait`` seconds later); Slurm's ``--signal=B:USR1@<seconds>`` sends SIGUSR1 that long before the time
limit. On either signal the run finishes the training step under way (collection, update, weight sync, its
logging and a checkpoint due at it; an evaluation due at that step is skipped), writes a checkpoint of it, closes
its workers and exits with :data:`EXIT_PREEMPTED`. Starting the same command again resumes from that checkpoint
(``runner.resume_mode=auto``) and continues as the uninterrupted run would have. A second signal stops the run at
once, as Ctrl-C does (exit status 130; the checkpoints written so far stay).

The handlers are installed while the training loop runs, after the workers are built (``ray.init`` installs a
SIGTERM handler of its own, which they replace; it is put back afterwards). They only set a flag: the loop checks
it after each step (:meth:`PreemptionWatch.requested`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

#: the exit status of a run stopped by a preemption signal after writing its checkpoint (Kubernetes' podFailurePolicy
#: can match it with ``onExitCodes``; a Slurm script can requeue on it); 0 ends a run that reached runner.max_steps
EXIT_PREEMPTED = 75                 # sysexits.h EX_TEMPFAIL: a temporary failure, try again (resume)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """A run stopped on a preemption signal after writing its checkpoint (the message is one sentence). Not a
    :class:`~embodirl.errors.RunFailed`: the CLI exits with :data:`EXIT_PREEMPTED`."""


class PreemptionWatch:
    """Remembers the first preemption signal while installed (see module docstring)."""

    def __init__(self):
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _on_signal(self, signum, frame) -> None:
        if self.signal_name is not None:       # a second signal: stop now, through the same unwinding as Ctrl-C
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        # os.write, not print: a signal handler may run while this thread is inside a print to the same stream
        os.write(2, f"embodirl: {self.signal_name} received: finishing this training step, then writing a checkpoint "
                    f"and exiting with status {EXIT_PREEMPTED} (send it again to stop at once)\n".encode())

    @contextlib.contextmanager
    def installed(self):
        """The handlers, for the duration of the block (main thread only; elsewhere nothing is installed)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._on_signal)
        try:
            yield self
        finally:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            self._previous.clear()

    def stop(self, step: int, checkpoint) -> Preempted:
        """The sentence of a run stopped after ``step`` with ``checkpoint`` (None: no training step was done)."""
        if checkpoint is None:
            return Preempted(f"{self.signal_name} received before the first training step; nothing to save, run the "
                             "same command to start")
        return Preempted(f"{self.signal_name} received: stopped after training step {step} with its checkpoint "
                         f"{checkpoint}; run the same command to resume from it")
