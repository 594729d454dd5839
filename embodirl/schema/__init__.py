"""One typed schema for the whole configuration (Hydra structured configs).

:class:`Config` is registered in Hydra's ConfigStore as ``embodirl_schema`` and heads ``config/config.yaml``'s
defaults list, so Hydra composes the YAML options on top of it: the YAML tree holds every value, the schema
every type, range and choice (:mod:`.sections`; the ``algorithm`` section in :mod:`embodirl.algorithms.section`, next to
the code that runs on it; each env adapter's and policy's own config class, registered with it next to its code and
found by :mod:`.envs` and :mod:`.models`). :func:`check` runs on a
composed config (also a plain one, as a sweep job hands it over) and raises one
:class:`~embodirl.errors.ConfigError` sentence naming the first bad key:

1. types and unknown keys (also keys added with ``+``), section by section;
2. ranges and choice lists of every field;
3. each section's cross-field rules (``rules`` next to its fields), then the env and model rules, on the typed config
   (:func:`run_config`: the object the code then runs on).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from embodirl.algorithms.section import AlgorithmSection
from embodirl.config_fields import check_fields, check_finite, instance, required, section, template
from embodirl.errors import ConfigError
from embodirl.schema.envs import env_rules, env_schema
from embodirl.schema.models import model_rules, model_schema
from embodirl.schema.sections import SECTIONS, ActorSection, ClusterSection, EnvWorkersSection, RolloutSection, RunnerSection

__all__ = ["SCHEMA_NAME", "SECTIONS", "Config", "EnvSplits", "add_section", "check", "check_types",
           "error", "register", "run_config", "to_object", "typed", "unknown_key"]

SCHEMA_NAME = "embodirl_schema"


@dataclass
class Config:
    """The composed config. ``env`` (``train``/``eval``) and ``model`` are typed per adapter and per policy
    when checked (:func:`check`), since their keys depend on the option chosen."""

    runner: RunnerSection = section(RunnerSection)
    algorithm: AlgorithmSection = section(AlgorithmSection)
    rollout: RolloutSection = section(RolloutSection)
    env_workers: EnvWorkersSection = section(EnvWorkersSection)
    actor: ActorSection = section(ActorSection)
    cluster: ClusterSection = section(ClusterSection)
    env: Any = required()
    model: Any = required()


@dataclass
class EnvSplits:
    """``env`` of the typed config: the training and evaluation env splits, each its adapter's config class."""

    train: Any
    eval: Any


#: top-level sections another command adds to config.yaml's (``embodirl sft``'s ``sft``, ``data``): name -> schema
EXTRA_SECTIONS: dict[str, type] = {}


def add_section(name: str, schema: type) -> None:
    """Type a top-level section that another primary config adds (its dataclass, built with
    :mod:`embodirl.config_fields`, may carry ``rules(cfg, ctx)`` too); :func:`check` then checks it when present."""
    EXTRA_SECTIONS[name] = schema


def register() -> None:
    """Store :class:`Config` in Hydra's ConfigStore (idempotent); ``config.yaml`` lists it first."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)


_CONVERT = re.compile(r"Value '(.*)' of type '\w+' could not be converted to (\w+)")
_BOOL = re.compile(r"Value '(.*)' is not a valid bool")
_LIST = re.compile(r"is not a ListConfig, list or tuple")
_KINDS = {"Integer": "an integer", "Float": "a number", "Boolean": "true or false", "String": "a string"}


def _declared(schema: type, prefix: str, key: str) -> list[str]:
    """Keys of the (nested) section that holds ``key``, for a did-you-mean hint."""
    parts = key[len(prefix) + 1:].split(".")[:-1] if prefix else key.split(".")[:-1]
    for part in parts:
        fields = {f.name: f for f in dataclasses.fields(schema)}
        factory = fields[part].default_factory if part in fields else None
        if not dataclasses.is_dataclass(factory):
            return []
        schema = factory
    return [f.name for f in dataclasses.fields(schema)]


def unknown_key(key: str, schema: type | None = None, prefix: str = "") -> ConfigError:
    """One sentence for a key no section declares, with the closest declared key when there is one."""
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, _declared(schema or Config, prefix, key), n=1)
    hint = f" (did you mean {key.rsplit('.', 1)[0]}.{close[0]}?)" if close and "." in key else (
        f" (did you mean {close[0]}?)" if close else "")
    return ConfigError(key, f"unknown key{hint}; every key and its default is in config/ (embodirl train --cfg job)")


def error(exc: OmegaConfBaseException, schema: type | None = None, prefix: str = "") -> ConfigError:
    """An OmegaConf type or key error (merging onto ``schema`` at ``prefix``) as one sentence naming the key."""
    full_key = str(getattr(exc, "full_key", "") or "")
    key = f"{prefix}.{full_key}" if prefix and full_key else (full_key or prefix)
    first = str(exc).splitlines()[0].strip().rstrip(".")
    if isinstance(exc, ConfigKeyError) or first.startswith("Key '"):
        return unknown_key(key, schema, prefix)
    match = _CONVERT.search(first)
    if match:
        return ConfigError(key, f"must be {_KINDS.get(match.group(2), match.group(2).lower())}, got '{match.group(1)}'")
    match = _BOOL.search(first)
    if match:
        return ConfigError(key, f"must be true or false, got '{match.group(1)}'")
    if _LIST.search(first):
        return ConfigError(key, "must be a list, e.g. [1, 2]")
    return ConfigError(key, first[0].lower() + first[1:] if first else type(exc).__name__)


def typed(schema: type, node: Any, prefix: str = "", *, closed: bool = True) -> DictConfig:
    """``node`` merged onto ``schema``: a wrong type, an undeclared key (``closed``) or a missing key is a
    :class:`ConfigError` naming it. An open schema types only the keys it declares."""
    if not closed:
        names = {f.name for f in dataclasses.fields(schema)}
        node = {k: node[k] for k in node if k in names}
    try:
        merged = cast(DictConfig, OmegaConf.merge(template(schema), node))    # merged onto a DictConfig
    except OmegaConfBaseException as exc:
        raise error(exc, schema, prefix) from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{prefix}.{missing[0]}" if prefix else missing[0],
                          "is missing from the configuration (see config/config.yaml and the option files)")
    return merged


def to_object(schema: type, node: Any, prefix: str = ""):
    """``node`` as an instance of the section dataclass ``schema``: an instance passes through; a DictConfig or plain
    dict is checked first (types, then ranges and choices: one :class:`ConfigError` sentence naming the key) and
    converted once. Code above the schema holds these instances, never the nodes."""
    if isinstance(node, schema):
        return node
    return instance(schema, typed(schema, node, prefix), prefix)


def run_config_unresolved(cfg: Any) -> Config:
    """:func:`run_config` with the ``auto`` values of :func:`resolve_fast_inference` left as they are."""
    from embodirl.envs.registry import env_config
    from embodirl.models.registry import model_config

    sections = {name: instance(schema, getattr(cfg, name), name) for name, schema in SECTIONS.items()}
    env = EnvSplits(train=env_config(cfg.env.train, "env.train"), eval=env_config(cfg.env.eval, "env.eval"))
    return Config(**sections, env=env, model=model_config(cfg.model))


def run_config(cfg: Any) -> Config:
    """A composed and validated config as the typed object the code runs on: every section its schema dataclass,
    ``env.train``/``env.eval`` their adapters' config classes and ``model`` its policy's (:class:`EnvSplits`,
    :func:`embodirl.envs.registry.env_config`, :func:`embodirl.models.registry.model_config`). Converted once, where a
    command takes the config; a :class:`Config` passes through. Sections another command adds (``sft``, ``data``)
    are that command's to convert."""
    if isinstance(cfg, Config):
        return cfg
    return resolve_fast_inference(resolve_worker_counts(run_config_unresolved(cfg)))


def resolve_worker_counts(run: Config, placement=None) -> Config:
    """``rollout.num_workers`` and ``env_workers.num_workers`` set to ``auto`` (the defaults), decided from the devices
    (``placement``: the parsed ``cluster.component_placement``, default detected): on GPUs, for the policy families
    registered to run through Ray (the VLAs), one inference worker per
    device of the ``rollout`` component and one env worker per device of the ``env`` component (fewer where
    ``env.train.num_envs`` does not split into whole groups over them); on CPU slots or with ``cluster.use_ray=false``,
    one of each (the in-process default job and every CPU run as they were). An explicit count stays as given."""
    import dataclasses

    from embodirl.placement import placement_from_config

    if "auto" not in (run.rollout.num_workers, run.env_workers.num_workers):
        return run
    placement = placement or placement_from_config(run.cluster)
    from embodirl.models.registry import policy_family

    # GPUs, for the families that run through Ray workers (the VLAs; the state MLP's default job stays in one
    # process), unless cluster.use_ray=false keeps everything in one process
    gpu = (placement.accelerator == "gpu" and run.cluster.use_ray is not False
           and policy_family(run.model.name).ray)
    inference = run.rollout.num_workers
    if inference == "auto":
        inference = len(placement.devices["rollout"]) if gpu else 1
    envs = run.env_workers.num_workers
    if envs == "auto":
        envs = 1
        if gpu:     # the most env workers, up to one per device, that hold whole groups in every pipeline stage
            per_stage = int(run.env.train.num_envs) // max(int(run.rollout.pipeline_stage_num), 1)
            group = max(int(run.algorithm.group_size), 1)
            envs = max([k for k in range(1, len(placement.devices["env"]) + 1)
                        if per_stage % k == 0 and (per_stage // k) % group == 0] or [1])
    return dataclasses.replace(run, rollout=dataclasses.replace(run.rollout, num_workers=int(inference)),
                               env_workers=dataclasses.replace(run.env_workers, num_workers=int(envs)))


def resolve_fast_inference(run: Config, accelerator: str | None = None) -> Config:
    """``rollout.merge_lora``, ``rollout.compile`` and ``algorithm.recompute_old_logprob`` set to ``auto`` (the
    defaults), decided: merging and compiling the inference workers' copies where they run on GPUs (``accelerator``:
    ``gpu`` or ``cpu``, default detected from ``cluster``) through Ray and the policy family can (an adapter to merge,
    blocks to compile); and the actor re-scoring the actions, with the truncated importance weights of
    ``algorithm.behaviour_is_cap``, whenever either is on (their numerics differ from the actor's). An explicit value
    stays as given."""
    import dataclasses

    from embodirl.models.registry import policy_family
    from embodirl.placement import detect_devices, use_ray

    rollout, algorithm = run.rollout, run.algorithm
    if "auto" not in (rollout.merge_lora, rollout.compile, algorithm.recompute_old_logprob):
        return run
    if accelerator is None:
        accelerator = detect_devices(run.cluster.num_nodes, run.cluster.num_gpus_per_node)[1]
    fast = accelerator == "gpu" and use_ray(run)
    family = policy_family(run.model.name)
    lora = getattr(run.model, "lora", None)
    merge = (fast and family.merge and lora is not None and bool(lora.enabled)
             if rollout.merge_lora == "auto" else bool(rollout.merge_lora))
    compiled = fast and family.compile if rollout.compile == "auto" else bool(rollout.compile)
    recompute = (merge or compiled if algorithm.recompute_old_logprob == "auto"
                 else bool(algorithm.recompute_old_logprob))
    return dataclasses.replace(run, rollout=dataclasses.replace(rollout, merge_lora=merge, compile=compiled),
                               algorithm=dataclasses.replace(algorithm, recompute_old_logprob=recompute))


@dataclass
class Context:
    """What several sections' rules need: the device placement and what follows from it; and the typed config they
    were checked on (:func:`run_config`)."""

    placement: Any
    dp: int
    use_ray: bool
    config: Config


def check_types(cfg: DictConfig) -> None:
    """Steps 1 and 2 of :func:`check`: every key declared and of its type, every value in range and among its
    choices (no rule between keys, no device placement)."""
    from omegaconf import OmegaConf

    check_finite(OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg)
    own = {k: v for k, v in cfg.items() if k not in ("env", "model") and k not in EXTRA_SECTIONS}
    typed(Config, own | {"env": {}, "model": {}})
    for name, schema in EXTRA_SECTIONS.items():
        if name in cfg:
            typed(schema, cfg[name], name)
            check_fields(schema, cfg[name], name)
    if not isinstance(getattr(cfg, "env", None), DictConfig | dict) or set(cfg.env.keys()) != {"train", "eval"}:
        raise ConfigError("env", "must hold exactly train and eval (an env option fills both)")
    for name, schema in SECTIONS.items():
        check_fields(schema, cfg[name], name)
    for split in ("train", "eval"):
        schema, closed = env_schema(cfg.env[split], f"env.{split}")
        typed(schema, cfg.env[split], f"env.{split}", closed=closed)
        check_fields(schema, cfg.env[split], f"env.{split}")
    model, closed = model_schema(cfg.model)
    typed(model, cfg.model, "model", closed=closed)
    check_fields(model, cfg.model, "model")


def check(cfg: DictConfig, *, num_devices: int | None = None, accelerator: str | None = None) -> Context:
    """Types, ranges, choices and cross-field rules of a composed config (see the module docstring). The rules of
    the sections declared here read the typed config; those of a section another command adds, the composed one."""
    from embodirl.placement import data_parallel_size, placement_from_config, use_ray

    check_types(cfg)
    unresolved = cfg if isinstance(cfg, Config) else run_config_unresolved(cfg)
    placement = placement_from_config(unresolved.cluster, num_devices, accelerator)
    # the devices placed on decide the autos: worker counts first (Ray or not follows from them), then fast inference
    run = resolve_fast_inference(resolve_worker_counts(unresolved, placement), placement.accelerator)
    ctx = Context(placement=placement, dp=data_parallel_size(run, placement), use_ray=use_ray(run), config=run)
    for schema in SECTIONS.values():
        rules = getattr(schema, "rules", None)
        if rules is not None:
            rules(run, ctx)
    for name, schema in EXTRA_SECTIONS.items():
        rules = getattr(schema, "rules", None) if name in cfg else None
        if rules is not None:
            rules(cfg, ctx)
    env_rules(run)
    model_rules(run)
    return ctx
