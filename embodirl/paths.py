"""Where embodirl finds its own files: the Hydra config tree, project-local system libraries,
and the per-user cache. Works from a source checkout and from an installed wheel."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# A source checkout has config/ next to the package; a wheel carries a copy inside the package.
_CHECKOUT_ROOT = PACKAGE_DIR.parent


def source_root() -> Path | None:
    """The repository root when running from a checkout (editable install or PYTHONPATH)."""
    if (_CHECKOUT_ROOT / "config").is_dir() and (_CHECKOUT_ROOT / "pyproject.toml").is_file():
        return _CHECKOUT_ROOT
    return None


def config_dir() -> Path:
    """The Hydra config tree: ``<checkout>/config`` or ``embodirl/_config`` inside a wheel."""
    override = os.environ.get("EMBODIRL_CONFIG_DIR")
    if override:
        return Path(override).resolve()
    root = source_root()
    if root is not None:
        return root / "config"
    bundled = PACKAGE_DIR / "_config"
    if bundled.is_dir():
        return bundled
    raise FileNotFoundError(
        f"embodirl cannot find its config tree: neither {_CHECKOUT_ROOT / 'config'} nor {bundled} exists; "
        "reinstall the package or set EMBODIRL_CONFIG_DIR."
    )


def cache_dir() -> Path:
    """Per-user writable cache (``EMBODIRL_HOME``, default ``~/.cache/embodirl``)."""
    path = Path(os.environ.get("EMBODIRL_HOME", Path.home() / ".cache" / "embodirl")).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


def deps_dir() -> Path:
    """Project-local system libraries unpacked by scripts/setup.sh (Mesa 25 lavapipe)."""
    override = os.environ.get("EMBODIRL_DEPS_DIR")
    if override:
        return Path(override).resolve()
    root = source_root()
    return (root / ".deps") if root is not None else (cache_dir() / "deps")


def inside(root: str | os.PathLike, name: str) -> Path | None:
    """``root / name`` when ``name`` (a file name read from a dataset's or a checkpoint's own metadata) stays inside
    ``root``, else None: an absolute name or one whose ``..`` parts climb out is refused. Lexical, so a checkpoint
    whose files are symlinks (the Hugging Face cache's snapshots) still loads."""
    if os.path.isabs(name):
        return None
    base = os.path.normpath(os.fspath(root))
    path = os.path.normpath(os.path.join(base, name))
    return Path(path) if os.path.commonpath([base, path]) == base and path != base else None
