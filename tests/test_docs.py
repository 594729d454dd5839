"""The documentation holds: the configuration reference is what the schema and the YAML tree generate, README.md and
docs/ name no internal work items, the site builds with warnings as errors, and every ``embodirl`` command line in a
code block of README.md or docs/ composes and validates (``--cfg job``: Hydra's print of the composed, checked config,
which writes nothing) or is listed in COVERED with the test that runs it.

A command whose text needs what only an earlier command or the user's machine has gets a stand-in: a checkpoint or
run folder that does not exist here is ``null`` (``PATH_KEYS``), a ``<placeholder>`` likewise, and a placement for
GPUs the machine lacks gets ``MACHINE``'s device count. Every other override is composed exactly as written, so a
renamed or removed key, a wrong value or a broken rule fails here.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

#: internal work-item references: the README and docs speak to users, history lives in CHANGELOG.md
INTERNAL = re.compile(r"\b(issue|item|round|ticket) \d+\b", re.IGNORECASE)
#: dated history in the front door ("until 2026-11-28 ...")
HISTORY = re.compile(r"\b(until|since) 20\d\d-\d\d-\d\d\b", re.IGNORECASE)

#: documented command text -> (the test that runs it, strings that test contains): refusals that need files on disk
COVERED = {
    "embodirl train env=maniskill_pushcube_rgb model=openvla_oft_tiny model.path=untrained algorithm=grpo "
    "env.train.use_fixed_reset_state_ids=true":
        ("tests/sft/test_rl_ready.py", ["algorithm=grpo", "env.train.use_fixed_reset_state_ids=true", "never trained"]),
}
#: keys whose value names a checkpoint or run folder; one that does not exist here composes as null
PATH_KEYS = ("model.path", "model.base_path", "runner.resume_dir")
#: placements for more devices than this machine has: the device count of the machine they are written for
MACHINE = {'"env: 0-7; rollout: 8-15; actor: 0-15"': ["cluster.num_gpus_per_node=8"]}
_COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_]+=\S+ +)*(?:bin/|\.venv/bin/)?embodirl +(\w+)\b(.*)$")
_FENCE = re.compile(r"^ *```")


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current():
    generator = _load_generator()
    assert generator.PAGE.read_text() == generator.generate(), (
        "docs/reference/configuration.md is stale: run .venv/bin/python scripts/gen_config_reference.py")


def test_configuration_reference_lists_every_key():
    from omegaconf import OmegaConf

    from embodirl.config import compose
    from embodirl.schema import SECTIONS

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    cfg = OmegaConf.to_container(compose([]), resolve=False)

    def leaves(node, prefix):
        if isinstance(node, dict) and node and prefix != "cluster.component_placement":
            for key, value in node.items():
                yield from leaves(value, f"{prefix}.{key}")
        else:
            yield prefix

    missing = [key for name in SECTIONS for key in leaves(cfg[name], name) if f"`{key}`" not in page]
    missing += [f"env.train.{k}" for k in cfg["env"]["train"] if f"`env.train.{k}" not in page]
    missing += [f"model.{k}" for k in cfg["model"] if f"`model.{k}" not in page]
    assert not missing, f"keys missing from the configuration reference: {missing}"


def test_no_internal_references():
    found = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for pattern in (INTERNAL, HISTORY) if page.name == "README.md" else (INTERNAL,):
                match = pattern.search(line)
                if match:
                    found.append(f"{page.relative_to(ROOT)}:{n}: {match.group(0)}")
    assert not found, "internal work-item references or history in the docs (history goes to CHANGELOG.md): " + \
        "; ".join(found)


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    # the two commands it starts with, exactly (CI runs the second through .ci/run)
    assert readme.startswith("```bash\nbin/embodirl train      # sets itself up on first use, then runs the default "
                             "training job\nbin/test                # sets itself up on first use, then runs the whole "
                             "test suite (slow tests included)\n```\n")


def test_site_builds_with_warnings_as_errors(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": str(Path(sys.executable).parent)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]


def documented_commands() -> list[tuple[str, str, str | None]]:
    """``(where, command text, refusal)`` for every embodirl command line in a code block: continuations joined,
    comments dropped; ``refusal``: the ``embodirl: ...`` line a ``$ `` transcript shows after it."""
    found = []
    for page in PAGES:
        lines, inside = page.read_text().splitlines(), False
        for n, line in enumerate(lines):
            if _FENCE.match(line):
                inside = not inside
                continue
            if not inside or not _COMMAND.match(line.strip()):
                continue
            text, k = line.strip(), n
            while text.endswith("\\") and k + 1 < len(lines):
                k += 1
                text = text[:-1].rstrip() + " " + lines[k].strip()
            text = _drop_comment(text)
            after = lines[k + 1].strip() if k + 1 < len(lines) else ""
            refusal = after if text.startswith("$ ") and after.startswith("embodirl:") else None
            found.append((f"{page.relative_to(ROOT)}:{n + 1}", text.removeprefix("$ "), refusal))
    return found


def _drop_comment(text: str) -> str:
    quote = None
    for i, ch in enumerate(text):
        if ch in "'\"":
            quote = None if quote == ch else (quote or ch)
        elif ch == "#" and quote is None and i and text[i - 1] == " ":
            return text[:i].rstrip()
    return text


def _args(text: str) -> tuple[str, list[str]]:
    """(command, overrides) with env-variable prefixes dropped and ``<placeholders>`` as one token."""
    words = [w for w in shlex.split(re.sub(r"<[^>]*>", "PLACEHOLDER", text)) if w not in ("...", "…")]
    while "=" in words[0] and not words[0].startswith("embodirl"):
        words.pop(0)
    return words[1], words[2:]


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _stand_ins(args: list[str], cwd: Path) -> list[str]:
    """``args`` with the stand-ins of the module docstring: a checkpoint path that is neither here nor a hub id (as
    ``model.path`` takes one) and a run folder that is not here compose as null."""
    out = []
    for arg in args:
        key, _, value = arg.partition("=")
        if key in PATH_KEYS and value not in ("null", "disable", "auto"):
            hub_id = key != "runner.resume_dir" and _HUB_ID.match(value) and "PLACEHOLDER" not in value
            if not hub_id and not (cwd / value).exists():
                arg = f"{key}=null"
        out.append(arg)
    for marker, extra in MACHINE.items():
        if any(marker in a for a in args):
            out += extra
    return out


def _sweep(args: list[str]) -> list[list[str]]:
    """A ``-m`` sweep's jobs: every combination of the comma-separated values."""
    choices = [[f"{a.partition('=')[0]}={v}" for v in a.partition("=")[2].split(",")] if "=" in a and "," in a
               and not a.partition("=")[2].startswith(("[", "{", '"', "'")) else [a] for a in args]
    return [list(job) for job in itertools.product(*choices)]


COMMANDS = documented_commands()


def test_every_documented_command_is_found():
    """The extraction itself: the README's commands and the pages' are seen (a fence or prompt change that hid them
    all would pass the test below vacuously)."""
    where = {w.split(":")[0] for w, _, _ in COMMANDS}
    assert "README.md" in where and "docs/cli.md" in where and len(COMMANDS) >= 40, sorted(where)
    assert {_args(text)[0] for _, text, _ in COMMANDS} >= {"train", "eval", "sft", "demos", "doctor", "compare"}


#: runs each ``embodirl`` argv through the CLI's entry point (``embodirl.cli.main``, what the console script calls),
#: one after another in one process started for them: the imports are paid once, not once per command
DRIVER = r"""
import contextlib, io, json, os, sys
os.chdir(sys.argv[1])
from embodirl import cli
results = []
for argv in json.load(sys.stdin):
    out, err, saved = io.StringIO(), io.StringIO(), sys.argv[:]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if argv[0] == "compare":    # its config without its checkpoints (checked when it runs)
                from embodirl.compare.compose import compose
                from embodirl.config import validate
                from embodirl.errors import ConfigError
                try:
                    validate(compose(argv[1:])[0])
                except ConfigError as exc:
                    print(f"embodirl: {exc}", file=sys.stderr)
                    code = 2
            else:
                cli.main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception as exc:   # noqa: BLE001 - reported as the command's failure
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            code = 1
    sys.argv[:] = saved
    results.append([code, err.getvalue()[-2000:]])
print(json.dumps(results))
"""


def _without_bench(args: list[str]) -> list[str]:
    """``doctor --bench [--gpus N]`` composes the config ``doctor`` does: the bench's own flags dropped."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--gpus":
            skip = True
        elif arg != "--bench" and not arg.startswith("--gpus="):
            out.append(arg)
    return out


def _jobs(text: str, cwd: Path) -> list[list[str]]:
    """The argvs a documented command runs as here: ``--cfg job`` added, stand-ins applied, a sweep's jobs apart."""
    command, args = _args(text)
    args = _without_bench(args)
    flags = [a for a in args if a.startswith("-")]
    assert set(flags) <= {"--cfg", "-m"}, f"`{text}`: flags the test does not know: {flags}"
    overrides = _stand_ins([a for a in args if not a.startswith("-") and a != "job"], cwd)
    if command == "compare":
        return [["compare", *overrides]]
    return [[command, "--cfg", "job", *job] for job in (_sweep(overrides) if "-m" in flags else [overrides])]


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    """argv (a tuple) -> (exit status, standard error) for every documented command, and the folder they ran in."""
    cwd = tmp_path_factory.mktemp("commands")
    argvs = sorted({tuple(job) for _, text, _ in COMMANDS if text not in COVERED for job in _jobs(text, cwd)})
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(cwd)], input=json.dumps(argvs), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {argv: tuple(result) for argv, result in zip(argvs, results)}, cwd


@pytest.mark.parametrize(("where", "text", "refusal"), COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_documented_command_composes(composed, where, text, refusal):
    if text in COVERED:
        test_file, needles = COVERED[text]
        source = (ROOT / test_file).read_text()
        assert all(n in source for n in needles), f"{test_file} no longer runs `{text}`"
        return
    results, cwd = composed
    for job in _jobs(text, cwd):
        code, stderr = results[tuple(job)]
        if refusal is None:
            assert code == 0, f"{where}: `{text}` does not compose: {stderr}"
            continue
        assert code == 2, f"{where}: `{text}` was not refused (exit status {code})"
        message = stderr.strip().splitlines()[-1]
        at = 0
        for part in (p.strip() for p in refusal.split("...") if p.strip()):
            found = message.find(part, at)
            assert found >= 0, f"{where}: the page shows `{refusal}`, the command says `{message}`"
            at = found + len(part)


def test_documented_commands_write_nothing(composed):
    _, cwd = composed
    assert list(cwd.iterdir()) == [], "`--cfg job` wrote files"
