"""π0 (Black et al. 2024) on transformers' ``PI0ForConditionalGeneration``, trained with RL as πRL does (Flow-SDE or
Flow-Noise log-probabilities of the denoising chain). Registered as policy ``pi0`` (``model=pi0``, ``model=pi0_tiny``).

* ``schema.py`` - the typed ``model`` keys;
* ``flow.py``   - the denoising chain as Gaussian transitions: Flow-SDE and Flow-Noise;
* ``openpi.py`` - openpi's inputs: resize-with-pad, prompt cleaning, the float32 parameters;
* ``cache.py``  - the VLM's and the action expert's key/value caches, safe under gradient checkpointing;
* ``heads.py``  - the value head and Flow-Noise's noise head;
* ``lora.py``   - what trains: the action expert in full or LoRA adapters, and the weights with adapters folded in;
* ``policy.py`` - the :class:`Pi0Policy`: inputs, the chain, log-probs, values, the compiled and reference modes;
* ``checkpoint.py`` - the transformers checkpoint layout (config, weights, statistics, heads, tokenizer), read and
  written;
* ``lerobot.py`` - LeRobot's π0 checkpoint layout (its config.json, weight names and normaliser files);
* ``build.py``  - the policy from ``model``: a random network of its sizes or a checkpoint, the heads, what trains.
"""

from __future__ import annotations

from embodirl.envs.conventions import ANY_ARM, SIGNED_CLOSE_POSITIVE, ActionConvention
from embodirl.models.pi0.build import build_policy
from embodirl.models.pi0.policy import Pi0Policy
from embodirl.models.pi0.schema import Pi0ModelConfig
from embodirl.models.registry import SFT_FLOW, register_policy

__all__ = ["Pi0Policy", "build_policy", "build_pi0"]


#: π0's LIBERO checkpoints (openpi's, LeRobot's, RLinf's) emit LIBERO's gripper: -1 open, +1 close
ACTION_CONVENTION = ActionConvention(arm=ANY_ARM, gripper=SIGNED_CLOSE_POSITIVE)


@register_policy("pi0", config=Pi0ModelConfig, ray=True, sft=SFT_FLOW, merge=True, compile=True, value_head=True,
                 action_convention=ACTION_CONVENTION)
def build_pi0(model_cfg, env_spec) -> Pi0Policy:
    """Registry builder: ``builder(model_cfg, env_spec) -> Policy``."""
    return build_policy(model_cfg, env_spec)


def _check_config(model_cfg) -> None:
    """Cheap checks before any worker starts: the typed keys, the sizes' consistency, the checkpoint folder."""
    from embodirl.config_fields import instance
    from embodirl.errors import ConfigError
    from embodirl.models.pi0.build import network_config
    from embodirl.models.pi0.checkpoint import check_checkpoint
    from embodirl.models.pi0.lora import lora_on_expert

    model = instance(Pi0ModelConfig, model_cfg, "model")
    if model.path:
        check_checkpoint(model.path)
    else:
        network_config(model)
    if len(model.flow.noise_std_range) != 2:
        raise ConfigError("model.flow.noise_std_range", f"{model.flow.noise_std_range} must be [min, max]")
    low, high = model.flow.noise_std_range
    if not 0 < low <= high:
        raise ConfigError("model.flow.noise_std_range", f"[{low}, {high}] must be two standard deviations 0 < min <= max")
    targets = model.lora.target_modules
    targets = [targets] if isinstance(targets, str) else list(targets)
    if model.lora.enabled and model.train_expert and {"all-linear", "expert"} & set(targets):
        raise lora_on_expert(model.lora.target_modules)      # before any worker starts (a layer name: at build)


def _describe_checkpoint(path) -> str:
    from embodirl.models.pi0.checkpoint import check_checkpoint

    return check_checkpoint(path)


def _check_spec(model_cfg, env_spec) -> None:
    """The images π0 takes against the env's cameras."""
    from embodirl.config_fields import instance
    from embodirl.models.pi0.build import _image_count

    _image_count(instance(Pi0ModelConfig, model_cfg, "model"), env_spec)


build_pi0.check_config = _check_config
build_pi0.check_spec = _check_spec
build_pi0.describe_checkpoint = _describe_checkpoint
