"""Errors that reach the user as one sentence (the CLI prints them and exits with status 2)."""


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key and says how to fix it."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}" if key else message)


class AssetsMissing(FileNotFoundError):
    """Data a simulator task needs is not on disk; the message names it and the command that fetches it."""


class RunFailed(RuntimeError):
    """A run cannot go on (a learner rank died and no restart is left); the message is one sentence and
    says where the last complete checkpoint is. The CLI prints it and exits with status 1."""
