"""Named components imported on first use: simulator adapters, policies and rollout backends.

Each kind keeps a :class:`LazyRegistry`: a table of built-in names -> the module that registers them
on import (so choosing ``env=maniskill_*`` never imports LIBERO), plus whatever a module registers
with :meth:`LazyRegistry.register` (a user's own component registers itself the same way).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from embodirl.errors import ConfigError


class LazyRegistry:
    """``what``: the kind in messages ("policy"); ``key``: the config key that names one
    ("model.name"); ``modules``: built-in name -> module registering it."""

    def __init__(self, what: str, key: str, modules: Mapping[str, str]):
        self.what, self.key = what, key
        self._modules = dict(modules)
        self._entries: dict[str, Any] = {}

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: ``@registry.register("name")`` on a class or builder function."""
        def wrap(obj):
            self._entries[name] = obj
            return obj

        return wrap

    def available(self) -> list[str]:
        return sorted(set(self._modules) | set(self._entries))

    def get(self, name: str, key: str | None = None) -> Any:
        """The entry ``name``, importing its module first; an unknown name is a
        :class:`~embodirl.errors.ConfigError` on ``key`` listing the available ones."""
        if name not in self._entries:
            module = self._modules.get(name)
            if module is None:
                raise ConfigError(key or self.key, f"unknown {self.what} '{name}'; available: "
                                                   f"{', '.join(self.available())}")
            importlib.import_module(module)
        return self._entries[name]


#: rollout backends (``rollout.backend``): here rather than in :mod:`embodirl.workers.backends`, whose layer sits
#: above the schema that lists the names
BACKENDS = LazyRegistry("rollout backend", "rollout.backend", {
    "huggingface": "embodirl.workers.backends.huggingface",
})
