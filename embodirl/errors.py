"""Errors that reach the user as one sentence (the CLI prints them and exits with status 2)."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key and says how to fix it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self):
        # crosses processes (Ray workers) whole: rebuilt from its text, not by calling __init__ again
        return _restore, (type(self), self.key, str(self))


def _restore(cls: type[ConfigError], key: str, text: str) -> ConfigError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, text)
    exc.key = key
    return exc


class AssetsMissing(FileNotFoundError):
    """Data a simulator task needs is not on disk; the message names it and the command that fetches it."""


class RunFailed(RuntimeError):
    """A run cannot go on (an actor rank died and no restart is left); the message is one sentence and
    says where the last complete checkpoint is. The CLI prints it and exits with status 1."""


class NonFiniteUpdate(RunFailed):
    """A loss term or the gradient of an update is not finite: the optimizer step was not taken (the weights are
    the previous step's). The message names the training step and the term."""


class AlreadyTrained(RuntimeError):
    """A training run's folder already holds a checkpoint at ``runner.max_steps``: there is nothing to train. The
    message is one sentence saying how to continue; the CLI prints it and exits with status 3, not 0, so that a script
    does not take a run that trained nothing for one that trained."""


def last_line(exc: BaseException) -> str:
    """The message of an exception, also when Ray wrapped it (its last non-empty line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__).rstrip(".")
