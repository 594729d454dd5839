"""The installed environment is the locked one: every package in constraints.txt at its locked version, every
direct dependency's range admitting its locked version, and the set-up installing through the lock."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "constraints.txt"


def locked() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            assert pinned, f"constraints.txt: '{line}' is not an exact pin (name==version)"
            pins[canonicalize_name(name)] = pinned
    return pins


def public(v: str) -> Version:
    """A version without its local build label (torch 2.13.0+cpu -> 2.13.0)."""
    return Version(Version(v).public)


def test_installed_versions_are_the_locked_ones():
    off = []
    for name, pinned in sorted(locked().items()):
        try:
            installed = version(name)
        except PackageNotFoundError:
            off.append(f"{name} is not installed (locked {pinned})")
            continue
        if public(installed) != public(pinned):
            off.append(f"{name} {installed} (locked {pinned})")
    assert not off, ("installed versions left constraints.txt: " + "; ".join(off)
                     + "; run scripts/setup.sh, or regenerate the lock after testing the new versions")


def test_direct_dependency_ranges_admit_the_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = locked()
    requirements = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    for req in requirements:
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a direct dependency but not in constraints.txt"
        assert req.specifier, f"{req.name} has no version range in pyproject.toml"
        assert req.specifier.contains(public(pins[name]), prereleases=True), \
            f"pyproject.toml's {req} excludes the locked {name}=={pins[name]}"
    transformers = next(r for r in requirements if canonicalize_name(r.name) == "transformers")
    assert not transformers.specifier.contains("4.57.0") and not transformers.specifier.contains("6.0.0")


def test_setup_installs_through_the_lock():
    script = (ROOT / "scripts" / "setup.sh").read_text()
    assert re.search(r'PIP\+=\(-c "\$ROOT/constraints\.txt"\)', script)
    stamp = script[script.index("stamp_value() {"):script.index("}", script.index("stamp_value() {"))]
    assert "constraints.txt" in stamp, "the set-up stamp must change when the lock does"
