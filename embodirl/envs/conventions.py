"""Action conventions: what the dims of an action vector mean, declared on both sides of the policy-env contract, and
the one place that converts between them.

A policy family declares what it emits (``register_policy(..., action_convention=...)``, a checkpoint's or the
config's ``model.action_convention`` overriding it), a simulator adapter what it consumes natively
(``action_convention(cfg)`` on the adapter). :func:`pairing` checks a pair before any worker starts (one sentence
naming the key when it cannot be converted) and returns the :class:`ActionConversion` every run applies where the
rollout hands a chunk to the env (:class:`~embodirl.rollout.collector.RolloutCollector`): training, evaluation and the
evaluation of an SFT run step the env with ``to_env(action_chunk)``, and ``embodirl sft`` reads a dataset recorded in
the env's convention (``embodirl demos``) through ``from_env``, so the SFT policy learns the convention it declares.

**Gripper** (the last action dim), one of :data:`GRIPPERS`:

============================  ========  ==================================================================
``open01``                    [0, 1]    1 = open, 0 = close; binarised at 0.5 when converted: OpenVLA-OFT's
                                        ``normalize_gripper_action(binarize=True)``, ``sign(2g - 1)``
``signed_close_positive``     [-1, 1]   -1 = open, +1 = close: LIBERO / robosuite native (robosuite's gripper
                                        moves by the command's sign); π0's LIBERO checkpoints emit it
``signed_open_positive``      [-1, 1]   -1 = close, +1 = open: ManiSkill's normalised finger-joint target
``none``                      -         no gripper dim: every dim passes unchanged
============================  ========  ==================================================================

and, for a policy only, ``native``: it emits what the env consumes (trained from scratch in it: the state MLP).

A conversion decodes the policy's gripper command into an openness ``o`` (+1 open, -1 close) and encodes that in the
env's: ``open01`` decodes as ``sign(2g - 1)``, the signed ones as ``-g`` and ``g``; ``open01`` encodes as
``(o + 1) / 2``. OpenVLA-OFT into LIBERO is therefore ``-sign(2g - 1)``, OFT's ``invert_gripper_action`` after its
binarisation bit for bit (``g == 0.5`` gives 0: robosuite keeps the fingers' command), as RLinf's
``prepare_actions_for_libero`` converts OpenVLA(-OFT) only (``rlinf/envs/action_utils.py`` @ a3816b59), and π0 into
LIBERO is the identity, as openpi's ``examples/libero/main.py`` (@ 15a9616a) and LeRobot's ``envs/libero.py``
(@ 7427f318) send π0's actions unchanged.

**Arm** (the other dims): a named action space (:data:`OSC_POSE_DELTA` for LIBERO, ``maniskill/<control_mode>``,
...), or for a policy :data:`ANY_ARM` (it learns the env's: a random init, or SFT on the env's own demos). Arm spaces
are not converted: a policy trained in one runs only in an env that consumes the same.

A leaf: numpy only (simulator processes import it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from embodirl.errors import ConfigError

OPEN01 = "open01"
SIGNED_CLOSE_POSITIVE = "signed_close_positive"
SIGNED_OPEN_POSITIVE = "signed_open_positive"
NO_GRIPPER = "none"
#: a policy's gripper (and arm) in whatever the env consumes: nothing to convert
NATIVE = "native"
#: the encodings an env may consume, and what a policy may emit besides ``native``
GRIPPERS = (OPEN01, SIGNED_CLOSE_POSITIVE, SIGNED_OPEN_POSITIVE, NO_GRIPPER)
POLICY_GRIPPERS = (*GRIPPERS, NATIVE)
#: the [low, high] range of each gripper encoding's command
GRIPPER_RANGE = {OPEN01: (0.0, 1.0), SIGNED_CLOSE_POSITIVE: (-1.0, 1.0), SIGNED_OPEN_POSITIVE: (-1.0, 1.0)}
#: OpenVLA-OFT's threshold: ``open01`` commands above it open (``sign(2g - 1)``)
OPEN01_THRESHOLD = 0.5

#: a policy's arm learned in the env's own action space
ANY_ARM = "any"
#: robosuite's OSC_POSE controller as LIBERO drives it: 6-D end-effector delta (position, axis-angle), each in
#: [-1, 1] of the controller's largest step
OSC_POSE_DELTA = "osc_pose_delta"


@dataclass(frozen=True)
class ActionConvention:
    """What an action vector means: ``arm`` (its first dims: a named action space, or :data:`ANY_ARM` for a policy)
    and ``gripper`` (its last dim: one of :data:`POLICY_GRIPPERS`)."""

    arm: str
    gripper: str

    def __str__(self) -> str:
        return f"arm {self.arm}, gripper {self.gripper}"


#: what a policy trained from scratch in the env emits: the env's own actions
NATIVE_CONVENTION = ActionConvention(arm=ANY_ARM, gripper=NATIVE)


def _openness(gripper: np.ndarray, encoding: str) -> np.ndarray:
    """A gripper command in ``encoding`` -> +1 open / -1 close (``open01`` binarised at its threshold)."""
    if encoding == OPEN01:
        return np.sign(2.0 * gripper - 1.0)          # OFT's normalize_gripper_action(binarize=True)
    if encoding == SIGNED_CLOSE_POSITIVE:
        return -gripper
    return gripper


def _command(openness: np.ndarray, encoding: str) -> np.ndarray:
    """+1 open / -1 close -> a gripper command in ``encoding``."""
    if encoding == OPEN01:
        return (openness + 1.0) / 2.0
    if encoding == SIGNED_CLOSE_POSITIVE:
        return -openness                             # OFT's invert_gripper_action
    return openness


@dataclass(frozen=True)
class ActionConversion:
    """Actions of a policy of convention ``policy`` to an env of convention ``env`` and back (build it with
    :func:`pairing`, which checks the pair). Arrays ``[..., A]``; the arm dims pass unchanged."""

    policy: ActionConvention
    env: ActionConvention

    @property
    def identity(self) -> bool:
        p, e = self.policy.gripper, self.env.gripper
        return p == e or NATIVE in (p, e) or NO_GRIPPER in (p, e)

    def _convert(self, actions: np.ndarray, source: str, target: str) -> np.ndarray:
        actions = np.asarray(actions)
        if self.identity:
            return actions
        out = actions.copy()
        out[..., -1] = _command(_openness(actions[..., -1], source), target)
        return out

    def to_env(self, actions: np.ndarray) -> np.ndarray:
        """The policy's action chunk ``[..., A]`` as the env consumes it."""
        return self._convert(actions, self.policy.gripper, self.env.gripper)

    def from_env(self, actions: np.ndarray) -> np.ndarray:
        """Actions recorded in the env's convention (a demonstration dataset) as the policy emits them."""
        return self._convert(actions, self.env.gripper, self.policy.gripper)

    def policy_bounds(self, low, high, action_dim: int) -> tuple[list[float], list[float]]:
        """The env's action bounds (a number or ``[A]`` each) in the policy's convention: the gripper dim's range is the
        policy's encoding's."""
        low = np.broadcast_to(np.asarray(low, np.float64), (action_dim,)).tolist()
        high = np.broadcast_to(np.asarray(high, np.float64), (action_dim,)).tolist()
        if not self.identity and self.policy.gripper in GRIPPER_RANGE:
            low[-1], high[-1] = GRIPPER_RANGE[self.policy.gripper]
        return low, high


def pairing(policy: ActionConvention | None, env: ActionConvention | None, *, model_name: str = "the policy",
            env_key: str = "env.train", adapter: str = "its adapter") -> ActionConversion:
    """The conversion from ``policy``'s actions to ``env``'s; a :class:`ConfigError` (one sentence naming the key) when
    either convention is unknown or the pair cannot be converted. ``model_name``, ``env_key``, ``adapter``: for the
    sentence."""
    if env is None:
        raise ConfigError(f"{env_key}.adapter", f"simulator adapter '{adapter}' declares no action convention, so "
                                                f"{model_name}'s actions cannot be checked against what it consumes; give "
                                                "the adapter action_convention(cfg) returning an "
                                                "embodirl.envs.conventions.ActionConvention")
    if env.gripper not in GRIPPERS or env.arm == ANY_ARM:
        raise ConfigError(f"{env_key}.adapter", f"simulator adapter '{adapter}' declares {env}, but an env consumes a "
                                                f"named arm space and a gripper among {', '.join(GRIPPERS)}")
    if policy is None:
        raise ConfigError("model.action_convention", f"{model_name} declares no action convention, so its actions "
                                                     f"cannot be converted to what {env_key} ({adapter}) consumes "
                                                     f"({env}); set model.action_convention.arm and .gripper")
    if policy.gripper not in POLICY_GRIPPERS:
        raise ConfigError("model.action_convention.gripper", f"'{policy.gripper}' is not one of "
                                                             f"{', '.join(POLICY_GRIPPERS)}")
    if policy.arm != ANY_ARM and policy.arm != env.arm:
        raise ConfigError("model.action_convention.arm", f"{model_name} acts in the arm space {policy.arm} but "
                                                         f"{env_key} ({adapter}) consumes {env.arm}, and arm spaces "
                                                         "cannot be converted; choose an env of that action space")
    if policy.gripper == NO_GRIPPER and env.gripper != NO_GRIPPER:
        raise ConfigError("model.action_convention.gripper", f"{model_name} emits no gripper command but {env_key} "
                                                             f"({adapter}) consumes one ({env.gripper}); choose a "
                                                             "policy with a gripper dim")
    return ActionConversion(policy=policy, env=env)


def policy_spec(env_spec, policy: ActionConvention | None):
    """``env_spec`` (an :class:`~embodirl.envs.base.EnvSpec`) as a policy of convention ``policy`` sees it: the action
    bounds in the policy's convention. A spec without a declared convention, or a policy with none, passes unchanged."""
    declared = getattr(env_spec, "action_convention", None)
    if declared is None or policy is None:
        return env_spec
    conversion = ActionConversion(policy=policy, env=declared)
    if conversion.identity:
        return env_spec
    low, high = conversion.policy_bounds(env_spec.action_low, env_spec.action_high, env_spec.action_dim)
    return dataclasses.replace(env_spec, action_low=low, action_high=high)
