"""Policy families by name (``model.name`` in the config), imported lazily, each registered with what it can do.

A family is one package (or module) plus one YAML under ``config/model/``. Its builder is registered with
:func:`register_policy` together with its config class and its capability flags (:class:`PolicyFamily`), and called
as ``builder(model, env_spec: EnvSpec) -> Policy`` with ``model`` an instance of that config class
(:func:`model_config` converts a composed node once). Optional attributes of the builder: ``check_config(model)``
(cheap checks before any worker starts), ``check_spec(model, env_spec)`` (checks against the env's spec, in the driver,
once the first env worker has reported it: :func:`check_policy_spec`; a Ray worker that built the policy would
otherwise die with the sentence inside a traceback), ``check_run(cfg, path)`` (rules between a checkpoint and the
run) and ``describe_checkpoint(path) -> str`` (``embodirl doctor``'s checkpoint row; raises ConfigError for a folder
it cannot use).

The rest of embodirl reads the flags, never lists of names: the placement (``ray``: ``cluster.use_ray=auto`` runs it
through Ray worker groups), ``embodirl sft`` (``sft``: which loss), the rollout rules (``merge``, ``compile``), the
model rules (``value_head``) and the policy-env contract (``action_convention``, :mod:`embodirl.envs.conventions`).

A family outside embodirl registers under its module's dotted name (``@register_policy(__name__, config=...)`` in
``my_pkg/my_policy.py``; ``name: my_pkg.my_policy`` in its YAML), imported the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from embodirl.envs.conventions import ActionConvention
from embodirl.registry import POLICIES

available_policies = POLICIES.available

#: ``sft``: what ``embodirl sft`` trains - the action tokens (cross-entropy; OpenVLA-OFT's L1 head and stop token as
#: options) or a flow-matching chunk (π0)
SFT_TOKENS, SFT_FLOW = "action_tokens", "flow_matching"
SFT_LOSSES = (SFT_TOKENS, SFT_FLOW)


@dataclass(frozen=True)
class PolicyFamily:
    """A registered family: its builder and what it can do."""

    build: Callable
    ray: bool = False                # a VLA: under cluster.use_ray=auto its rollouts go through Ray worker groups
    sft: str | None = None           # embodirl sft fine-tunes it with this loss (SFT_LOSSES); None: not at all
    merge: bool = False              # rollout.merge_lora can fold its LoRA adapters into an inference copy
    compile: bool = False            # rollout.compile can compile an inference copy (Policy.compile_blocks_)
    value_head: bool = False         # model.value_type gives it a critic (GAE, PPO)
    #: what its actions mean: an ActionConvention, or ``fn(model) -> ActionConvention`` where a checkpoint says more;
    #: None: undeclared (a run refuses to pair it with an env); ``model.action_convention`` overrides either
    action_convention: ActionConvention | Callable | None = None


def register_policy(name: str, *, config: type | None = None, ray: bool = False, sft: str | None = None,
                    merge: bool = False, compile: bool = False, value_head: bool = False,
                    action_convention: ActionConvention | Callable | None = None) -> Callable:
    """Decorator on a builder ``(model, env_spec) -> Policy``: ``@register_policy("name", config=MyConfig, ray=...,
    sft=..., merge=..., compile=..., value_head=..., action_convention=...)``; ``model.name=name`` then selects it.
    Returns the builder (its optional hooks are set as its attributes, see the module docstring)."""
    if sft is not None and sft not in SFT_LOSSES:
        raise ValueError(f"sft must be None or one of {', '.join(SFT_LOSSES)}, got {sft!r}")

    def wrap(builder: Callable) -> Callable:
        POLICIES.register(name, config=config)(PolicyFamily(builder, ray=ray, sft=sft, merge=merge, compile=compile,
                                                            value_head=value_head, action_convention=action_convention))
        return builder

    return wrap


def policy_family(name: str, key: str = "model.name") -> PolicyFamily:
    """The registered family ``name`` (its module imported first when needed); an unknown name is a ConfigError on
    ``key`` listing the known ones."""
    return POLICIES.get(name, key)


def get_policy_builder(name: str, key: str = "model.name"):
    return policy_family(name, key).build


def model_config(node: Any):
    """The ``model`` group as its policy's typed config (:class:`~embodirl.models.base.CommonModelConfig` or the
    subclass the policy registered with), converted once; an instance passes through."""
    return POLICIES.typed(node, "model")


def policy_convention(model_cfg: Any) -> ActionConvention | None:
    """What the configured policy's actions mean: ``model.action_convention``'s keys where set, else what the family
    declares (for the config, e.g. its checkpoint); None: neither says."""
    model = model_config(model_cfg)
    declared = policy_family(model.name).action_convention
    if callable(declared):
        declared = declared(model)
    override = model.action_convention
    arm = override.arm or (declared.arm if declared is not None else None)
    gripper = override.gripper or (declared.gripper if declared is not None else None)
    return ActionConvention(arm=arm, gripper=gripper) if arm and gripper else None


def make_policy(model_cfg: Any, env_spec):
    """The policy ``model_cfg`` describes, built for ``env_spec`` as the policy sees it (action bounds in its own
    convention: :func:`embodirl.envs.conventions.policy_spec`)."""
    from embodirl.envs.conventions import policy_spec

    model = model_config(model_cfg)
    return get_policy_builder(model.name)(model, policy_spec(env_spec, policy_convention(model)))


def check_policy_spec(model_cfg: Any, env_spec) -> None:
    """The policy's cheap checks against ``env_spec`` (its builder's ``check_spec``; a :class:`ConfigError`), run
    where the driver learns the spec, before any inference worker or actor rank builds the policy."""
    model = model_config(model_cfg)
    check = getattr(get_policy_builder(model.name), "check_spec", None)
    if check is not None:
        check(model, env_spec)
