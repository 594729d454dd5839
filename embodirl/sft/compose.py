"""``embodirl sft``'s configuration: ``config.yaml`` composed with the command line's group and key overrides,
plus ``config/sft.yaml`` (its ``sft`` / ``data`` sections, set with ``sft.<key>=`` / ``data.<key>=``, and its
``runner`` values for the keys the command line leaves alone), then checked in one sentence per problem
before any simulator or actor starts (:func:`check`)."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from embodirl.errors import ConfigError
from embodirl.paths import config_dir
from embodirl.sft.section import Data, Sft, SftSections

SFT_FILE = "sft.yaml"
OWN_SECTIONS = ("sft", "data")
#: the SFT keys of the action-token loss (OpenVLA-OFT's); a flow-matching family (π0) trains its own loss only
TOKENS_ONLY = ("l1_head", "stop_token")


def compose(overrides: Sequence[str]) -> DictConfig:
    """The SFT run's config (see module docstring)."""
    from embodirl.config import compose as compose_main
    from embodirl.overrides import apply_runner_defaults, apply_section_overrides, override_key

    own = [o for o in overrides if override_key(o).split(".")[0] in OWN_SECTIONS]
    rest = [o for o in overrides if o not in own]
    cfg = compose_main(rest)
    defaults = OmegaConf.load(config_dir() / SFT_FILE)
    assert isinstance(defaults, DictConfig)      # sft.yaml is a mapping of sections
    sections = OmegaConf.create({k: defaults[k] for k in OWN_SECTIONS})
    OmegaConf.set_struct(sections, True)
    apply_section_overrides(sections, own, SFT_FILE)
    apply_runner_defaults(cfg, defaults.runner, rest)
    OmegaConf.set_struct(cfg, False)
    cfg.sft = sections.sft
    cfg.data = sections.data
    OmegaConf.set_struct(cfg, True)
    return cfg


def main_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` without the SFT sections: what ``embodirl train`` would run (for its validation)."""
    container = OmegaConf.to_container(cfg)
    assert isinstance(container, dict)           # a DictConfig's container
    for key in OWN_SECTIONS:
        container.pop(key, None)
    out = OmegaConf.create(container)
    OmegaConf.set_struct(out, True)
    return out


def sections(cfg: DictConfig) -> SftSections:
    """The ``sft`` and ``data`` sections as their typed objects, their types and ranges checked (one sentence naming
    the key)."""
    from embodirl.schema import to_object

    return SftSections(sft=to_object(Sft, cfg.sft, "sft"), data=to_object(Data, cfg.data, "data"))


def check(cfg: DictConfig) -> SftSections:
    """The SFT-specific rules that need no dataset (the dataset's are in :func:`check_dataset`); returns the typed
    ``sft`` and ``data`` sections the run then reads."""
    from embodirl.models.registry import SFT_FLOW, available_policies, policy_family
    from embodirl.schema import to_object
    from embodirl.schema.sections import RunnerSection

    loss = policy_family(cfg.model.name).sft
    if loss is None:
        able = [name for name in available_policies() if policy_family(name).sft is not None]
        raise ConfigError("model.name", f"is {cfg.model.name}, a policy family embodirl sft cannot fine-tune (it is "
                                        f"registered without sft); use one that it can: {', '.join(able)}")
    own = sections(cfg)
    if not own.data.path:
        raise ConfigError("data.path", "is not set; point it at a LeRobot dataset folder (meta/info.json inside), "
                                       "e.g. one written by `embodirl demos env=maniskill_pushcube_rgb`")
    to_object(RunnerSection, cfg.runner, "runner")      # its types and ranges, before the rules below read it
    s = own.sft
    if loss == SFT_FLOW:
        for key in TOKENS_ONLY:
            if getattr(s, key):
                raise ConfigError(f"sft.{key}", f"is OpenVLA-OFT's; {cfg.model.name} trains its flow-matching loss only, "
                                                f"so leave it {'null' if key == 'stop_token' else 'false'}")
        if not s.token_loss:
            raise ConfigError("sft.token_loss", f"is false, but it is {cfg.model.name}'s flow-matching loss: nothing "
                                                "would be trained")
    else:
        if not s.token_loss and not s.l1_head:
            raise ConfigError("sft.token_loss", "is false and sft.l1_head is false: nothing would be trained")
        if s.l1_head and cfg.model.use_l1_regression is not True:
            raise ConfigError("sft.l1_head", "trains OFT's L1 regression head, which the model has only with "
                                             "model.use_l1_regression=true")
        if s.l1_head and cfg.model.lora.enabled and not cfg.actor.fsdp.full_finetune and \
                "action_head" not in list(cfg.model.lora.modules_to_save or []):
            raise ConfigError("sft.l1_head", "needs the L1 head trainable: add action_head to "
                                             "model.lora.modules_to_save (e.g. "
                                             "model.lora.modules_to_save=[value_head,proprio_projector,action_head])")
    _check_common(cfg, s)
    return own


def _check_common(cfg: DictConfig, s: Sft) -> None:
    from embodirl.placement import data_parallel_size, placement_from_config
    from embodirl.schema import to_object
    from embodirl.schema.sections import ClusterSection

    ranks = data_parallel_size(cfg, placement_from_config(to_object(ClusterSection, cfg.cluster, "cluster")))
    if ranks != 1:
        raise ConfigError("actor.cpu_world_size", f"gives {ranks} actor ranks, but embodirl sft runs one actor "
                                                  "rank in this process for now; set it to 1 (one GPU)")
    if float(cfg.actor.ema_decay) > 0:
        raise ConfigError("actor.ema_decay", "averages the weights over RL training steps for evaluation; embodirl sft "
                                             "exports the trained weights, so leave it 0")
    micro = s.micro_batch_size or s.batch_size
    if micro > s.batch_size:
        raise ConfigError("sft.micro_batch_size", f"is {micro}, more than sft.batch_size={s.batch_size}")


def trained_chunk(cfg: DictConfig) -> tuple[int, str]:
    """The chunk length SFT trains and the key that sets it: π0 learns the whole chunk its network predicts
    (``model.chunk_size``, of which RL runs ``model.action_chunk``), OpenVLA-OFT the chunk it runs."""
    from embodirl.models.registry import model_config

    model = model_config(cfg.model)
    chunk_size = getattr(model, "chunk_size", None)      # a key of π0's config class
    if chunk_size is not None:
        return chunk_size, "model.chunk_size"
    return model.action_chunk, "model.action_chunk"


def check_chunk(cfg: DictConfig, dataset) -> None:
    """The trained chunk against the dataset's shortest episode: needs no simulator, so the CLI checks it before
    it starts the one that tells the env's spec."""
    H, key = trained_chunk(cfg)
    shortest = int(min(dataset.episode_lengths))
    if H > shortest:
        raise ConfigError(key, f"is {H} but the shortest episode of {dataset.root} has {shortest} frames; "
                               "use a chunk no longer than the episodes")


def check_dataset(cfg: DictConfig, dataset, spec) -> list[str]:
    """Dataset against env and model: action dim, cameras, proprio, chunk length. Returns the dataset's
    camera keys in the env's camera order (the images the policy sees)."""
    from embodirl.demos.lerobot.layout import camera_key

    path = dataset.root
    if dataset.action_dim != spec.action_dim:
        raise ConfigError("data.path", f"{path} holds {dataset.action_dim}-D actions but env {spec.name or 'env.train'} "
                                       f"takes {spec.action_dim}-D actions; record the demos in this env "
                                       "(`embodirl demos env=...`) or choose the env they were recorded in")
    from embodirl.models.registry import model_config

    model_dim = getattr(model_config(cfg.model), "action_dim", None)     # a key of OpenVLA-OFT's config class
    if model_dim is not None and int(model_dim) != dataset.action_dim:
        raise ConfigError("model.action_dim", f"is {model_dim} but {path} holds {dataset.action_dim}-D actions; set "
                                              "it to null (the env's)")
    check_chunk(cfg, dataset)
    wanted = [camera_key(name) for name in spec.camera_names]
    missing = [k for k in wanted if k not in dataset.camera_keys]
    if missing or not wanted:
        raise ConfigError("data.path", f"{path} has the cameras {', '.join(dataset.camera_keys) or 'none'} but env "
                                       f"{spec.name or 'env.train'} observes {', '.join(wanted) or 'no camera'}; "
                                       "record the demos with the env's cameras (env.train.obs_mode=rgb)")
    if spec.state_dim and dataset.state_dim != spec.state_dim:
        raise ConfigError("data.path", f"{path} has a {dataset.state_dim or 0}-D observation.state but the env's "
                                       f"state is {spec.state_dim}-D; record the demos in this env")
    return wanted
