"""Write docs/reference/configuration.md, the configuration reference, from the schema and the YAML tree.

    .venv/bin/python scripts/gen_config_reference.py            # rewrite the page
    .venv/bin/python scripts/gen_config_reference.py --check    # exit 1 when the committed page is stale

Every key of every section comes from the schema's dataclasses (embodirl/schema/, each simulator adapter's and
policy family's config class, the sections ``embodirl sft``, ``demos`` and ``compare`` add): its type from the
annotation, its allowed values from the field's metadata (:mod:`embodirl.config_fields`). The default is the value
the YAML tree composes to, and the description is the comment beside the key in the YAML file that sets it (with the
comment lines that continue it). tests/test_docs.py fails when the committed page differs from what this writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
PAGE = ROOT / "docs" / "reference" / "configuration.md"

_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w,]*):(?P<rest>.*)$")


def yaml_comments(path: Path) -> dict[str, str]:
    """``dotted.key -> comment`` for every key of a YAML file that carries a trailing comment; comment-only lines
    indented deeper than the key (aligned under its comment) continue it. ``defaults`` lists are skipped."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    last: str | None = None
    last_indent = -1
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            indent = len(line) - len(line.lstrip())
            if last is not None and indent > last_indent and last in comments:
                comments[last] += " " + stripped.lstrip("#").strip()
            else:
                last = None
            continue
        match = _KEY.match(line)
        if not match:
            if stripped and not stripped.startswith("-"):
                last = None
            continue
        indent, key, rest = len(match["indent"]), match["key"], match["rest"]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        dotted = ".".join(k for _, k in stack)
        last, last_indent = dotted, indent
        comment = _trailing_comment(rest)
        if comment:
            comments[dotted] = comment
    return {k: v for k, v in comments.items() if not k.startswith("defaults")}


def _trailing_comment(rest: str) -> str:
    """The comment after a value (`` # ...``), outside quotes."""
    quote = None
    for i, ch in enumerate(rest):
        if ch in "'\"":
            quote = None if quote == ch else (quote or ch)
        elif ch == "#" and quote is None and (i == 0 or rest[i - 1] == " "):
            return rest[i + 1:].strip()
    return ""


def type_name(annotation: Any) -> str:
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | None" if type(None) in args else "")
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def allowed(meta: Any, annotation: Any) -> str:
    from embodirl.config_fields import _is_int, _name, range_text

    if not meta:
        return ""
    extra = (" or null" if meta.get("null") else "") + (" or auto" if meta.get("auto") else "")
    if "range" in meta:
        if meta["range"][:2] == (None, None):
            return ("an integer" if meta.get("integer") or _is_int(annotation) else "a number") + extra
        return range_text(meta["range"], bool(meta.get("integer") or _is_int(annotation))) + extra
    if "choices" in meta:
        choices = meta["choices"]
        names = ", ".join(_name(c) for c in (choices() if callable(choices) else choices))
        known = " (or a registered component's dotted module name)" if meta.get("known") else ""
        return f"one of {names}{extra}{known}"
    return ""


def yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def rows(schema: type, node: Any, prefix: str, comments: dict[str, str], comment_prefix: str) -> list[tuple]:
    """(key, type, default, allowed, description) for every field of ``schema`` and its nested sections."""
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = node.get(f.name) if isinstance(node, dict) else None
        factory = f.default_factory
        if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
            out += rows(factory, value or {}, key, comments, f"{comment_prefix}.{f.name}" if comment_prefix else f.name)
            continue
        annotation = hints.get(f.name, f.type)
        comment = comments.get(f"{comment_prefix}.{f.name}" if comment_prefix else f.name, "")
        out.append((key, type_name(annotation), yaml_value(value), allowed(f.metadata, annotation), comment))
    return out


def _cell(text: str, code: bool = False) -> str:
    if code:
        return f"`{text}`" if text else ""
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def table(entries: list[tuple]) -> list[str]:
    lines = ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
    for key, typ, default, rule, comment in entries:
        lines.append(f"| `{key}` | {_cell(typ)} | {_cell(default.replace('`', ''), code=True)} | {_cell(rule)} | "
                     f"{_cell(comment)} |")
    return lines


def generate() -> str:
    from omegaconf import OmegaConf

    from embodirl.compare.compose import CompareSection
    from embodirl.config import compose
    from embodirl.demos.generate import DemosConfig
    from embodirl.envs.registry import ADAPTERS
    from embodirl.models.registry import POLICIES
    from embodirl.schema import SECTIONS
    from embodirl.sft.section import Data, Sft

    def plain(cfg) -> dict:
        return OmegaConf.to_container(cfg, resolve=False)

    main = plain(compose([]))
    main_comments = yaml_comments(CONFIG / "config.yaml")
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by scripts/gen_config_reference.py from embodirl/schema and config/; do not edit -->",
        "",
        "Every key `embodirl` reads, section by section: its type and allowed values from the schema "
        "(`embodirl/schema/` and the config classes registered next to each simulator adapter and policy family), "
        "its default as the YAML tree composes it for the default job (`embodirl train` with no overrides) or for "
        "the option named in the section's heading, and the comment beside it in that YAML file. "
        "[Configuration](../configuration.md) explains groups, overrides and validation; "
        "`embodirl train --cfg job [overrides]` prints any composed config.",
        "",
    ]
    for name, schema in SECTIONS.items():
        out += [f"## {name}", "", *table(rows(schema, main.get(name, {}), name, main_comments, name)), ""]

    out += ["## env.train and env.eval", "",
            "An env option (`env=<option>`, a file under `config/env/`) fills both env splits; `env@env.eval=<option>` "
            "evaluates on another one. Each split's keys are those of the option's simulator adapter.", ""]
    env_options = {"libero": ("libero_10", ["_base.yaml", "_libero_base.yaml"]),
                   "maniskill": ("maniskill_pushcube", ["_base.yaml", "_maniskill_base.yaml"]),
                   "toy": ("toy_reach", ["_base.yaml", "toy_reach.yaml"])}
    for adapter in ADAPTERS.available():
        schema = ADAPTERS.config_class(adapter)
        option, sources = env_options.get(adapter, (None, []))
        if schema is None or option is None:
            continue
        comments = {}
        for source in sources:      # the common keys' comments, then the adapter's own (which win)
            comments.update({k: v for k, v in yaml_comments(CONFIG / "env" / source).items() if v})
        node = plain(compose([f"env={option}"]))["env"]["train"]
        out += [f"### adapter: {adapter} (defaults of `env={option}`)", "",
                *table(rows(schema, node, "env.train", comments, "")), ""]

    out += ["## model", "", "A model option (`model=<option>`, a file under `config/model/`) selects a policy family; "
            "each family has its own keys.", ""]
    model_options = {"openvla_oft": ("openvla_oft", ["_openvla_oft_base.yaml", "openvla_oft.yaml"]),
                     "pi0": ("pi0", ["_pi0_base.yaml", "pi0.yaml"]), "state_mlp": ("state_mlp", ["state_mlp.yaml"])}
    for family in POLICIES.available():
        schema = POLICIES.config_class(family)
        option, sources = model_options.get(family, (None, []))
        if schema is None or option is None:
            continue
        comments: dict[str, str] = {}
        for source in sources:
            comments.update({k: v for k, v in yaml_comments(CONFIG / "model" / source).items() if v})
        node = plain(compose([f"model={option}"]))["model"]
        out += [f"### {family} (defaults of `model={option}`)", "", *table(rows(schema, node, "model", comments, "")), ""]

    sft_yaml = OmegaConf.to_container(OmegaConf.load(CONFIG / "sft.yaml"), resolve=False)
    sft_comments = yaml_comments(CONFIG / "sft.yaml")
    out += ["## sft and data (`embodirl sft`)", "",
            "`embodirl sft` takes `embodirl train`'s keys plus these (`config/sft.yaml`, which also sets its own "
            "`runner` defaults).", "",
            *table(rows(Sft, sft_yaml["sft"], "sft", sft_comments, "sft")[:] + rows(Data, sft_yaml["data"], "data",
                                                                                   sft_comments, "data")), ""]
    demos_yaml = OmegaConf.to_container(OmegaConf.load(CONFIG / "demos.yaml"), resolve=False)
    demo_rows = [r for r in rows(DemosConfig, demos_yaml, "", yaml_comments(CONFIG / "demos.yaml"), "")
                 if r[0] != "env"]
    out += ["## demos (`embodirl demos`)", "",
            "`config/demos.yaml`: top-level keys of `embodirl demos`, beside an `env` option (default "
            "`maniskill_pushcube_rgb`).", "", *table(demo_rows), ""]
    compare_yaml = OmegaConf.to_container(OmegaConf.load(CONFIG / "compare.yaml"), resolve=False)
    out += ["## compare (`embodirl compare`)", "",
            "`config/compare.yaml`: the `compare` section; every other key is `embodirl eval`'s.", "",
            *table(rows(CompareSection, compare_yaml["compare"], "compare", yaml_comments(CONFIG / "compare.yaml"),
                        "compare")), ""]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed page is stale")
    args = parser.parse_args()
    text = generate()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run .venv/bin/python scripts/gen_config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
