"""``embodirl compare``'s configuration: the command line's two checkpoints and overrides composed with ``config.yaml``
and ``config/compare.yaml``, each side's evaluation config built and checked, and the weights each side names found
and hashed, all before any worker starts. A problem is one :class:`~embodirl.errors.ConfigError` sentence naming the
key or file (the CLI prints it and exits with status 2).

Each side names a checkpoint of the policy ``model=`` selects:

* a **policy checkpoint**, what ``model.path`` takes (a folder with ``config.json``, e.g. a public OpenVLA-OFT
  checkpoint or ``embodirl sft``'s export; a state policy's ``.safetensors`` file): that side evaluates with
  ``model.path=<it>``;
* a **run's checkpoint**, ``checkpoints/step_<n>`` (a run folder or its ``checkpoints/`` folder: its latest complete
  one): that side evaluates with ``runner.resume_dir=<step_<n>>``, its ``policy/`` weights over the base weights of
  the shared ``model.path``, as ``embodirl eval runner.resume_dir=...`` does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from omegaconf import DictConfig, OmegaConf

from embodirl import checkpoint_layout as layout
from embodirl.config_fields import num, one_of, required
from embodirl.errors import ConfigError
from embodirl.overrides import apply_runner_defaults, apply_section_overrides, override_key
from embodirl.paths import config_dir
from embodirl.runner.paired import SPENDING
from embodirl.runner.weights import weights_digest
from embodirl.schema import Config

COMPARE_FILE = "compare.yaml"
#: the comparison's report in its output folder
INFO_FILE = "compare_info.json"
SECTION = "compare"
SIDES = ("a", "b")
#: the two kinds of checkpoint a side may name
MODEL_PATH, RUN_CHECKPOINT = "model_path", "run_checkpoint"
#: files of a training run's folder: compare never writes into one
RUN_MARKERS = (layout.CHECKPOINTS, "metrics.jsonl")


@dataclass
class CompareSection:
    """``config/compare.yaml``'s ``compare`` section (types and ranges here, values in the YAML)."""

    a: str | None = required()
    b: str | None = required()
    alpha: float = num(0, 1, lo_open=True, hi_open=True)
    sequential: bool = required()
    looks: int = num(2)
    spending: str = one_of(SPENDING)


@dataclass
class Side:
    """One side of the comparison: what it names and the evaluation config it runs with."""

    label: str                 # "a" | "b"
    path: Path                 # the checkpoint as given (absolute)
    kind: str                  # MODEL_PATH | RUN_CHECKPOINT
    step: int | None           # a run checkpoint's step
    weights: Path              # what was hashed: the model.path file/folder, or the checkpoint's policy/ folder
    sha256: str                # of the weights' files (relative names, sizes and bytes)
    cfg: Config                # this side's typed evaluation config
    out_dir: Path              # <compare folder>/<label>

    def record(self) -> dict:
        """This side in ``compare_info.json``."""
        return {"path": str(self.path), "kind": self.kind, "step": self.step, "weights": str(self.weights),
                "weights_sha256": self.sha256, "model": self.cfg.model.name, "model_path": self.cfg.model.path,
                "runner_resume_dir": self.cfg.runner.resume_dir, "eval_info": f"{self.label}/eval_info.json"}


@dataclass
class CompareJob:
    settings: CompareSection
    sides: tuple[Side, Side]
    out_dir: Path
    command_line: list[str]


def split_args(args: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """``(positional checkpoints, compare.* overrides, other overrides)``; a flag is refused in one sentence."""
    flags = [a for a in args if a.startswith("-")]
    if flags:
        raise ConfigError("", f"embodirl compare takes two checkpoints and Hydra overrides; {flags[0]} is not one "
                              "(print the evaluation's config with embodirl eval --cfg job [overrides])")
    positional = [a for a in args if "=" not in a and not a.startswith(("~", "+"))]
    own = [a for a in args if a not in positional and override_key(a).split(".")[0] == SECTION]
    rest = [a for a in args if a not in positional and a not in own]
    return positional, own, rest


def compose(args: Sequence[str]) -> tuple[DictConfig, CompareSection]:
    """The composed config both sides start from (``config/compare.yaml``'s runner values for the keys the command
    line leaves alone) and the typed ``compare`` section (positional checkpoints as ``compare.a``/``compare.b``)."""
    from embodirl.config import compose as compose_main
    from embodirl.schema import to_object

    positional, own, rest = split_args(args)
    cfg = compose_main(rest)
    # OmegaConf.load is typed for a list too; config/compare.yaml is a mapping
    defaults = cast(DictConfig, OmegaConf.load(config_dir() / COMPARE_FILE))
    section = OmegaConf.create({SECTION: defaults[SECTION]})
    OmegaConf.set_struct(section, True)
    apply_section_overrides(section, own, COMPARE_FILE)
    if positional:
        if len(positional) != 2:
            raise ConfigError("compare.a", f"embodirl compare takes two checkpoints, A and B, got {len(positional)} "
                                           f"({' '.join(positional)}); usage: embodirl compare <A> <B> [overrides]")
        for label, value in zip(SIDES, positional, strict=True):
            if section[SECTION][label] is not None:
                raise ConfigError(f"compare.{label}", f"is given twice: as compare.{label}= and as a positional "
                                                      "checkpoint; give one")
            section[SECTION][label] = value
    apply_runner_defaults(cfg, defaults.runner, rest)
    return cfg, to_object(CompareSection, section[SECTION], SECTION)


def resolve_side(label: str, given: str | None) -> tuple[Path, str, Path | None]:
    """``(path, kind, run checkpoint)`` of what a side names: a run's complete ``step_<n>`` folder (also found from
    a run folder or its ``checkpoints/``), else a policy checkpoint for ``model.path`` (a folder with ``config.json``
    or a file). One sentence naming ``compare.<label>`` when it is neither."""
    from embodirl.runner import checkpoint as ckpt

    key = f"compare.{label}"
    how = ("give a policy checkpoint (what model.path takes: a folder with config.json, a state policy's .safetensors "
           "file) or a run's checkpoints/step_<n> folder")
    if given in (None, ""):
        raise ConfigError(key, f"is not set; usage: embodirl compare <A> <B> [overrides]; {how}")
    path = Path(str(given)).expanduser().absolute()
    if not path.exists():
        raise ConfigError(key, f"{path} does not exist; {how}")
    if path.is_file():
        return path, MODEL_PATH, None
    found = ckpt.find_checkpoint(path)
    if found is not None:
        return path, RUN_CHECKPOINT, found.absolute()
    if ckpt.is_model_checkpoint(path):
        return path, MODEL_PATH, None
    if path.name.startswith("step_"):
        raise ConfigError(key, f"{path} has no {layout.COMPLETE} marker (its save was interrupted); use a complete "
                               "checkpoint of that run")
    raise ConfigError(key, f"{path} holds no checkpoint (no {layout.MODEL_CONFIG}, no checkpoints/step_<n>/ with a "
                           f"{layout.COMPLETE} marker); {how}")


def check_run_checkpoint(label: str, source: Path, model_name: str) -> None:
    """A run checkpoint was written by the policy family ``model=`` selects (its saved config says), before any
    worker starts; a checkpoint without a saved config is left to the load."""
    written = source / layout.CONFIG / "config.yaml"
    if not written.is_file():
        return
    try:
        name = OmegaConf.load(written).model.name
    except Exception:
        return
    if name != model_name:
        raise ConfigError(f"compare.{label}", f"{source} is a checkpoint of model.name={name} (its "
                                              f"{layout.CONFIG}/{written.name}), but model= selects {model_name}; "
                                              "give the model= it was trained with")


def check_output_dir(out_dir: Path, sides: Sequence[tuple[str, Path, Path | None]]) -> None:
    """The comparison writes its own folder: not a training run's, not inside a checkpoint it reads, not another
    comparison's (the same two checkpoints again write over their earlier report)."""
    earlier = out_dir / INFO_FILE
    if earlier.is_file():
        try:
            info = json.loads(earlier.read_text())
            compared = (info["a"]["path"], info["b"]["path"])
        except (ValueError, KeyError, TypeError):
            compared = None
        if compared != tuple(str(path) for _, path, _ in sides):
            what = f"the comparison of {compared[0]} and {compared[1]}" if compared else f"a {INFO_FILE}"
            raise ConfigError("runner.output_dir", f"{out_dir} holds {what}; choose another runner.output_dir for "
                                                   "these two checkpoints")
    for marker in RUN_MARKERS:
        if (out_dir / marker).exists():
            raise ConfigError("runner.output_dir", f"{out_dir} is a training run's folder (it holds {marker}); "
                                                   "embodirl compare writes a folder of its own: choose another "
                                                   "runner.output_dir")
    for label, path, source in sides:
        run = source.parent.parent if source is not None and source.parent.name == layout.CHECKPOINTS else None
        for inside in (path, source, run):
            if inside is not None and inside.is_dir() and out_dir.resolve().is_relative_to(inside.resolve()):
                raise ConfigError("runner.output_dir", f"{out_dir} is inside {inside}, which compare.{label} names; "
                                                       "choose a runner.output_dir outside the checkpoints compared")


def side_node(cfg: DictConfig, label: str, path: Path, kind: str, source: Path | None, out_dir: Path) -> DictConfig:
    """Side ``label``'s evaluation config: ``cfg`` as ``embodirl eval`` of that checkpoint, into ``out_dir/label``."""
    node = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg)))    # a mapping's copy is a DictConfig
    OmegaConf.set_struct(node, True)
    node.runner.only_eval = True
    node.runner.output_dir = str(out_dir / label)
    if kind == MODEL_PATH:
        node.model.path = str(path)
        node.runner.resume_dir = layout.DISABLE
    else:
        node.runner.resume_dir = str(source)
    return node


def prepare(args: Sequence[str]) -> CompareJob:
    """The comparison ``embodirl compare <args>`` describes, every check done (see module docstring)."""
    from embodirl.config import validate
    from embodirl.tools.doctor import preflight

    cfg, settings = compose(args)
    if cfg.runner.resume_dir not in (None, "", "auto"):
        raise ConfigError("runner.resume_dir", "is set, but embodirl compare loads each side from its own checkpoint "
                                               "(compare.a, compare.b); leave runner.resume_dir unset")
    if not cfg.runner.eval_greedy:
        raise ConfigError("runner.eval_greedy", "is false, but the pairs are the same episode only when both sides "
                                                "act greedily; leave runner.eval_greedy=true")
    resolved = [(label, *resolve_side(label, getattr(settings, label))) for label in SIDES]
    (_, path_a, _, source_a), (_, path_b, _, source_b) = resolved
    if (source_a or path_a).resolve() == (source_b or path_b).resolve():
        raise ConfigError("compare.b", f"names the same checkpoint as compare.a ({source_b or path_b}); compare two "
                                       "different checkpoints")
    out_dir = Path(cfg.runner.output_dir).expanduser().absolute()
    check_output_dir(out_dir, [(label, path, source) for label, path, _, source in resolved])
    sides = []
    for label, path, kind, source in resolved:
        if source is not None:
            check_run_checkpoint(label, source, cfg.model.name)
        try:
            typed = validate(side_node(cfg, label, path, kind, source, out_dir))
        except ConfigError as exc:
            if exc.key in ("model.path", "runner.resume_dir") or exc.key.startswith("model.path"):
                raise ConfigError(f"compare.{label}", f"as {exc.key}, {str(exc).split(': ', 1)[-1]}") from None
            raise
        weights = source / layout.POLICY if source is not None else path
        sides.append(Side(label=label, path=path, kind=kind, step=None, weights=weights, sha256="", cfg=typed,
                          out_dir=out_dir / label))
    preflight(sides[0].cfg)               # rendering, memory, video (PreflightFailed): both sides run this evaluation
    from embodirl.runner.checkpoint import checkpoint_step

    for i, (side, (_, _, _, source)) in enumerate(zip(sides, resolved, strict=True)):
        sides[i] = dataclasses.replace(side, step=checkpoint_step(source) if source is not None else None,
                                       sha256=weights_digest(side.weights))
    return CompareJob(settings=settings, sides=(sides[0], sides[1]), out_dir=out_dir, command_line=list(args))
