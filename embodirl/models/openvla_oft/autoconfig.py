"""Checkpoints that configure the model: what a checkpoint directory holds decides how the network is built.

OFT's own evaluation (``experiments/robot/libero/run_libero_eval.py`` of moojink/openvla-oft) takes the image
count, the proprio token and the action head from flags that must repeat how the checkpoint was trained; a
wrong flag loads without complaint and the policy then fails its task. Here the directory decides, for the
model keys left ``null``:

=====================  ================================================================  =====================
model key              read from the checkpoint                                          no checkpoint
=====================  ================================================================  =====================
``use_l1_regression``  ``action_head--<step>_checkpoint.pt`` present                      false (tokens)
``use_proprio``        ``proprio_projector--<step>_checkpoint.pt`` present                the env has a state
``num_images_in_input``  ``config.json`` ``num_images_in_input`` (embodirl writes it),    the env's cameras
                       else 2 when the checkpoint has OFT's heads (OFT's LIBERO recipe:   (at most 2)
                       agentview + wrist, proprio, L1 head: ``run_libero_eval.py``),
                       else 1 (token checkpoints: OFT's ``finetune.py`` default, the
                       agentview-only SFT checkpoints SimpleVLA-RL and RLinf start from)
``unnorm_key``         checked against ``dataset_statistics.json`` (or ``norm_stats``)    -
=====================  ================================================================  =====================

A value set explicitly that contradicts the checkpoint is a :class:`~embodirl.errors.ConfigError` naming the
key and the file. :func:`check_run` adds the rule that needs the whole run config: RL (which scores and
updates action tokens) from a checkpoint that acts through an L1 head is refused, since that checkpoint's
action tokens were never trained, unless its ``config.json`` records ``embodirl.action_tokens_trained: true``
(``embodirl sft`` with the token loss; RL then needs ``model.use_l1_regression=false`` to act through the tokens);
a checkpoint recording ``false`` is refused as well. The refusals name ``embodirl sft`` as the fix.

Only local directories and hub ids already in the Hugging Face cache are read before workers start; a hub id
still to be downloaded is configured by :func:`configure` with ``download=True`` when the policy is built.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from embodirl.config_fields import instance
from embodirl.errors import ConfigError
from embodirl.models.normalization import NO_NOOPS_SUFFIX, STATS_FILENAME
from embodirl.models.openvla_oft.schema import OpenVLAOFTConfig

CONFIG_FILE = "config.json"
NUM_IMAGES_KEY = "num_images_in_input"
ACTION_HEAD, PROPRIO = "action_head", "proprio_projector"
#: run_libero_eval.py GenerateConfig: num_images_in_input=2 with use_proprio and use_l1_regression
OFT_HEADS_IMAGES = 2
#: finetune.py's default; the token SFT checkpoints RL recipes start from see the agentview image only
TOKEN_CHECKPOINT_IMAGES = 1
#: an SFT checkpoint trained with action tokens, named in the refusal of RL from an L1 checkpoint
TOKEN_CHECKPOINT_EXAMPLE = "Haozhan72/Openvla-oft-SFT-libero10-traj1"
AUTO = "remove the setting (null reads it from the checkpoint)"
#: config.json["embodirl"] key written by ``embodirl sft`` (checkpoint.TOKENS_TRAINED)
TOKENS_TRAINED = "action_tokens_trained"
#: what the RL-ready refusals tell the user to run
SFT_COMMAND = "embodirl sft env=<env> model=<model> model.path=<this checkpoint> data.path=<LeRobot dataset>"


@dataclass(frozen=True)
class CheckpointContents:
    """What a checkpoint directory says about the network it was trained as."""

    directory: Path
    action_head: Path | None
    proprio_projector: Path | None
    recorded_images: int | None        # config.json's num_images_in_input, when written there
    statistics_file: Path | None
    statistics_keys: tuple[str, ...]
    tokens_trained: bool | None = None  # config.json's embodirl.action_tokens_trained (embodirl sft writes it)

    @property
    def num_images(self) -> int:
        if self.recorded_images is not None:
            return self.recorded_images
        has_oft_heads = self.action_head is not None or self.proprio_projector is not None
        return OFT_HEADS_IMAGES if has_oft_heads else TOKEN_CHECKPOINT_IMAGES


def _component(directory: Path, name: str) -> Path | None:
    from embodirl.models.openvla_oft.weights import find_component

    return find_component(directory, name)


def _json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, json.JSONDecodeError):
        return {}  # the loader reports an unreadable file by name


def _local_directory(path: str, download: bool) -> Path | None:
    from embodirl.models.openvla_oft.weights import HUB_ID, resolve_checkpoint_dir

    local = Path(path).expanduser()
    if local.is_dir():
        return local.resolve()
    if download or not HUB_ID.fullmatch(str(path)):
        return resolve_checkpoint_dir(path) if download else None
    try:  # a hub id: only what is already cached (no network before workers start)
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=str(path), local_files_only=True))
    except Exception:  # not cached (or no hub client): the worker configures it after the download
        return None


def inspect(path: str, *, download: bool = False) -> CheckpointContents | None:
    """The contents of checkpoint ``path`` (None: a hub id not in the local cache and ``download`` off)."""
    directory = _local_directory(str(path), download)
    if directory is None:
        return None
    from embodirl.models.openvla_oft.weights import check_readable

    check_readable(directory)            # a damaged file is one sentence now, not a worker's traceback later
    config = _json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
    recorded = config.get(NUM_IMAGES_KEY)
    if recorded is None:  # checkpoints written before the key existed carry the model section
        recorded = ((config.get("embodirl") or {}).get("model") or {}).get(NUM_IMAGES_KEY)
    statistics_file, keys = None, ()
    if (directory / STATS_FILENAME).is_file():
        statistics_file, keys = directory / STATS_FILENAME, tuple(sorted(_json(directory / STATS_FILENAME)))
    elif config.get("norm_stats"):
        statistics_file, keys = directory / CONFIG_FILE, tuple(sorted(config["norm_stats"]))
    trained = (config.get("embodirl") or {}).get(TOKENS_TRAINED)
    return CheckpointContents(directory=directory, action_head=_component(directory, ACTION_HEAD),
                              proprio_projector=_component(directory, PROPRIO),
                              recorded_images=int(recorded) if isinstance(recorded, int) else None,
                              statistics_file=statistics_file, statistics_keys=keys,
                              tokens_trained=trained if isinstance(trained, bool) else None)


def apply(model: OpenVLAOFTConfig, contents: CheckpointContents) -> OpenVLAOFTConfig:
    """``model`` with the null keys of the table above filled from ``contents``; an explicit value that
    contradicts the checkpoint raises :class:`ConfigError` naming the key and the file."""
    d = contents.directory
    head, proprio = contents.action_head, contents.proprio_projector
    l1 = model.use_l1_regression
    if l1 is True and head is None:
        raise ConfigError("model.use_l1_regression", f"is true but {d} has no {ACTION_HEAD}--<step>_checkpoint.pt "
                                                     f"(the checkpoint decodes action tokens); {AUTO}")
    if l1 is False and head is not None and not contents.tokens_trained:
        raise ConfigError("model.use_l1_regression", f"is false but {head} is the L1 action head {d} was trained to "
                                                     f"act with (its action tokens were never trained); {AUTO}")
    use_proprio = model.use_proprio
    if use_proprio is True and proprio is None:
        raise ConfigError("model.use_proprio", f"is true but {d} has no {PROPRIO}--<step>_checkpoint.pt (the "
                                               f"checkpoint was trained without the proprio token); {AUTO}")
    if use_proprio is False and proprio is not None:
        raise ConfigError("model.use_proprio", f"is false but {proprio} holds the proprio projector {d} was "
                                               f"trained with; {AUTO}")
    images = model.num_images_in_input
    if images is not None and contents.recorded_images is not None and int(images) != contents.recorded_images:
        raise ConfigError(f"model.{NUM_IMAGES_KEY}", f"is {images} but {d / CONFIG_FILE} records "
                                                     f"{NUM_IMAGES_KEY}={contents.recorded_images}; {AUTO}")
    return dataclasses.replace(model, use_l1_regression=head is not None and l1 is not False,
                               use_proprio=proprio is not None,
                               num_images_in_input=contents.num_images if images is None else images)


def configure(model_cfg, *, download: bool = False) -> OpenVLAOFTConfig:
    """The typed ``model`` section (a DictConfig or mapping of it is converted once) with :func:`apply` for its
    ``path`` (unchanged without a path, or for a hub id not cached and ``download`` off)."""
    model = instance(OpenVLAOFTConfig, model_cfg, "model")
    contents = inspect(str(model.path), download=download) if model.path else None
    return apply(model, contents) if contents is not None else model


def check_run(run, model_path: str | None) -> None:
    """The checks that need the run config: ``run`` is the whole typed config (:func:`embodirl.schema.run_config`),
    ``model_path`` the checkpoint the model loads (``model.path``, or for evaluation a model checkpoint in
    ``runner.resume_dir``)."""
    if not model_path:
        return
    model = dataclasses.replace(run.model, path=model_path)
    contents = inspect(model_path)
    if contents is None:
        return
    training = not run.runner.only_eval
    adv = run.algorithm.adv_type
    if training and contents.action_head is not None and contents.tokens_trained:
        if model.use_l1_regression is not False:
            raise ConfigError("model.use_l1_regression", f"{contents.directory} has trained action tokens and OFT's L1 "
                                                         f"head ({contents.action_head.name}), and RL "
                                                         f"(algorithm.adv_type={adv}) samples the tokens; set "
                                                         "model.use_l1_regression=false so the policy acts through "
                                                         "them")
    elif training and contents.action_head is not None:
        key = "model.use_l1_regression" if model.use_l1_regression is False else "model.path"
        raise ConfigError(key, f"{contents.directory} acts through OFT's L1 regression head "
                               f"({contents.action_head.name}), so its action tokens were never trained and RL over "
                               f"them (algorithm.adv_type={adv}) would start from an untrained token policy; train "
                               f"them first with `{SFT_COMMAND}` (or start from a checkpoint fine-tuned with action "
                               f"tokens, e.g. {TOKEN_CHECKPOINT_EXAMPLE}), or evaluate this one with `embodirl eval`")
    elif training and contents.tokens_trained is False:
        raise ConfigError("model.path", f"{contents.directory / CONFIG_FILE} records that its action tokens were never "
                                        f"trained, so RL over them (algorithm.adv_type={adv}) would start from an "
                                        f"untrained token policy; train them first with `{SFT_COMMAND}`")
    apply(model, contents)
    _check_unnorm_key(run, model, contents)


def _check_unnorm_key(run, model: OpenVLAOFTConfig, contents: CheckpointContents) -> None:
    if contents.statistics_file is None:
        return
    explicit = model.unnorm_key
    keys = [explicit] if explicit else [
        key for split in (run.env.train, run.env.eval) if (key := split.statistics_key)]
    available = set(contents.statistics_keys)
    for key in dict.fromkeys(keys):
        if key in available or key + NO_NOOPS_SUFFIX in available:
            continue
        listed = ", ".join(contents.statistics_keys) or "none"
        if explicit:
            raise ConfigError("model.unnorm_key", f"'{key}' (or '{key}{NO_NOOPS_SUFFIX}') is not in "
                                                  f"{contents.statistics_file}; available: {listed}")
        raise ConfigError("model.unnorm_key", f"is null, so the env suite '{key}' names the action statistics, but "
                                              f"neither it nor '{key}{NO_NOOPS_SUFFIX}' is in "
                                              f"{contents.statistics_file}; set it to one of: {listed}")
