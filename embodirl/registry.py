"""Named components imported on first use: simulator adapters, policies and inference engines.

Each kind keeps a :class:`LazyRegistry`: a table of built-in names -> the module that registers them
on import (so choosing ``env=maniskill_*`` never imports LIBERO), plus whatever a module registers
with :meth:`LazyRegistry.register` (a user's own component registers itself the same way). A component
declares its config class where it registers (``@register_adapter("toy", config=ToyEnvConfig)``): the schema
types its config group with it.

A component outside embodirl needs no entry in any table: it registers under its module's dotted name
(``@register_adapter(__name__, config=...)``) and its config names that module (``adapter: my_pkg.my_sim``), which
is imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from embodirl.errors import ConfigError


class LazyRegistry:
    """``what``: the kind in messages ("policy"); ``key``: the config key that names one
    ("model.name"); ``modules``: built-in name -> module registering it; ``common``: the dotted name of the config
    class with the keys every component of this kind has (imported on first use, as the components' modules are)."""

    def __init__(self, what: str, key: str, modules: Mapping[str, str], common: str | None = None):
        self.what, self.key = what, key
        self._modules = dict(modules)
        self._common = common
        self._entries: dict[str, Any] = {}
        self._configs: dict[str, type] = {}

    def register(self, name: str, *, config: type | None = None) -> Callable[[Any], Any]:
        """Decorator: ``@registry.register("name", config=ConfigClass)`` on a class or builder function;
        ``config``: the dataclass that types the component's config group (built with :mod:`embodirl.config_fields`)."""
        def wrap(obj):
            self._entries[name] = obj
            if config is not None:
                self._configs[name] = config
            return obj

        return wrap

    def _import(self, name: str) -> bool:
        """Import the module that registers ``name`` (a built-in's, or a dotted module name); False if none."""
        if name in self._entries:
            return True
        module = self._modules.get(name) or (name if "." in name else None)
        if module is None:
            return False
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if module in self._modules.values() or not str(module).startswith(str(exc.name or "")):
                raise
            return False
        return name in self._entries

    def config_class(self, name: str) -> type | None:
        """The config class ``name`` registered with (None: unknown name, or registered without one)."""
        return self._configs.get(name) if self._import(name) else None

    def available(self) -> list[str]:
        return sorted(set(self._modules) | set(self._entries))

    def typed(self, node: Any, prefix: str):
        """A config group (``node``: a DictConfig or a plain mapping) as the typed object of the component it names
        (the config class it registered with; else the common one: the keys every component of this kind has),
        checked and converted once; a config object (a dataclass instance) passes through."""
        import dataclasses

        from embodirl.config_fields import instance

        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            return node
        leaf = self.key.rsplit(".", 1)[-1]
        name = node.get(leaf)
        self.get(name, f"{prefix}.{leaf}")        # an unknown name is one sentence listing the known ones
        declared = self.config_class(name)
        if declared is None:       # registered without a config class: only the common keys are typed
            module, _, attr = str(self._common).rpartition(".")
            common = getattr(importlib.import_module(module), attr)
            names = {f.name for f in dataclasses.fields(common)}
            return instance(common, {k: v for k, v in node.items() if k in names}, prefix)
        return instance(declared, node, prefix)

    def get(self, name: str, key: str | None = None) -> Any:
        """The entry ``name``, importing its module first; an unknown name is a
        :class:`~embodirl.errors.ConfigError` on ``key`` listing the available ones."""
        if not self._import(name):
            raise ConfigError(key or self.key, f"unknown {self.what} '{name}'; available: "
                                               f"{', '.join(self.available())} (or a module that registers itself "
                                               "under its dotted name)")
        return self._entries[name]

    def known(self, name: str) -> bool:
        """``name`` is registered, or its module registers it when imported."""
        return self._import(name)


#: policy families (``model.name``): here rather than in :mod:`embodirl.models.registry` (which registers them with
#: their capability flags, :class:`~embodirl.models.registry.PolicyFamily`), so that the placement, whose layer sits
#: below the models, reads a family's ``ray`` flag
POLICIES = LazyRegistry("policy", "model.name", {
    "openvla_oft": "embodirl.models.openvla_oft",
    "pi0": "embodirl.models.pi0",
    "state_mlp": "embodirl.models.state_policy",
}, common="embodirl.models.base.CommonModelConfig")

#: inference engines (``rollout.backend``): here rather than in :mod:`embodirl.workers.engines`, whose layer sits
#: above the schema that lists the names
ENGINES = LazyRegistry("inference engine", "rollout.backend", {
    "huggingface": "embodirl.workers.engines.huggingface",
})
