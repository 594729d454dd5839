"""LIBERO-PRO's perturbed suites (embodirl/envs/libero/pro.py) on libero 0.1.1's code: the object variants are declared
as the package declares them, every perturbed task's BDDL file, instruction and initial states are read, one task of
each perturbed suite builds and steps from its initial states, and ``embodirl eval`` scores a checkpoint per
perturbation through the CLI."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import numpy as np
import pytest

from embodirl.envs.libero import paths as libero_paths
from embodirl.envs.libero import pro
from embodirl.envs.libero.simulator import LiberoAdapter, LiberoSimEnv
from embodirl.envs.libero.suite import placed_types, suite_info
from embodirl.errors import ConfigError
from tests.envs.test_libero import libero_cfg, noop_chunk

PRO_SUITES = [pro.suite_name(base, family) for base in pro.BASE_SUITES for family in pro.FAMILIES]
ARENA_FIXTURES = {"table", "main_table", "kitchen_table", "living_room_table", "study_table", "floor", "coffee_table"}


def _libero_objects_dir() -> Path:
    libero_paths.prepare()
    import libero.libero.envs.objects as objects

    return Path(objects.__file__).parent


def _declarations(folder: Path) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], str]]:
    """category -> (bases, decorators, body) of every object class in ``folder``'s modules, the body's own name strings
    replaced by a placeholder: two classes declared alike except for their names have equal bodies. The last
    declaration of a category wins, as it does at import."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None:
                continue
            names = [d.value for d in init.args.defaults if isinstance(d, ast.Constant) and isinstance(d.value, str)]
            if not names:
                continue
            body = ast.dump(ast.Module(body=node.body, type_ignores=[]))
            for name in set(names):
                body = body.replace(repr(name), "'<name>'")
            found[names[0]] = (tuple(ast.unparse(b) for b in node.bases),
                               tuple(ast.unparse(d) for d in node.decorator_list), body)
    return found


def test_variants_are_declared_as_the_package_declares_them():
    """Every category the perturbed suites place that LIBERO lacks is registered, as a subclass of the LIBERO class
    the package declares it like (same bases, decorators and body but for the names)."""
    ours = _declarations(_libero_objects_dir())
    theirs = _declarations(pro.data_root() / "envs" / "objects")
    placed = set()
    for suite in PRO_SUITES:
        for name in pro.task_names(suite):
            placed |= placed_types(pro.bddl_file(suite, name))
    new = placed - set(ours) - ARENA_FIXTURES
    assert new == set(pro.VARIANT_OF), "LIBERO-PRO places categories without a declared variant (or lists unused ones)"
    for category, like in pro.VARIANT_OF.items():
        assert theirs[category] == ours[like], f"{category} is not declared like LIBERO's {like}"

    pro.register_objects()
    from libero.libero.envs.base_object import OBJECTS_DICT, VISUAL_CHANGE_OBJECTS_DICT

    for category, like in pro.VARIANT_OF.items():
        variant = OBJECTS_DICT[category]
        assert variant.__mro__[1] is OBJECTS_DICT[like]
        assert (category in VISUAL_CHANGE_OBJECTS_DICT) == ("register_visual_change_object" in theirs[category][1])
        obj = variant()
        assert obj.name == category and obj.category_name == category
        reference = OBJECTS_DICT[like]()
        assert obj.rotation == reference.rotation and obj.rotation_axis == reference.rotation_axis
        assert Path(obj.file).is_file() and f"/{category}" in obj.file


def test_every_perturbed_task_has_its_files_and_fifty_states():
    for suite in PRO_SUITES:
        base = suite.rsplit("_", 1)[0]
        names = pro.task_names(suite)
        assert len(names) == 10, suite
        for name in names:
            bddl = pro.bddl_file(suite, name)
            assert bddl.is_file() and pro.instruction(bddl), (suite, name)
            states = pro.init_states(suite, name)
            assert states.shape[0] == 50 and states.dtype == np.float64 and np.all(np.isfinite(states)), (suite, name)
        assert names == pro.task_names(base) if base in pro._task_map() else True


def test_perturbed_instructions_are_the_bddl_files():
    """The language and task families change only the BDDL file's instruction (the file keeps the base task's name):
    the group's descriptions are the files' instructions, not the name-derived base ones."""
    env = LiberoAdapter.check_config(libero_cfg("libero_goal", perturbations=["none", "language", "task"]))
    info = suite_info(env)
    assert info.groups == ["libero_goal"] * 10 + ["libero_goal_lan"] * 10 + ["libero_goal_task"] * 10
    base, language, task = info.descriptions[:10], info.descriptions[10:20], info.descriptions[20:]
    assert base[0] == "open the middle drawer of the cabinet"
    assert language[0] == "open the cabinet’s middle drawer"
    assert task[0] == "open the bottom drawer of the cabinet"
    assert all(a != b for a, b in zip(base, language))
    assert [b.name for b in info.bddl_files[:10]] == [b.name for b in info.bddl_files[10:20]]


def test_perturbations_key_refusals():
    with pytest.raises(ConfigError, match=r"^perturbations: must be null or a list of distinct entries of none, "
                                          r"language, object, position, task"):
        LiberoAdapter.check_config(libero_cfg("libero_goal", perturbations=["lighting"]))
    with pytest.raises(ConfigError, match=r"^perturbations: must be null or a list of distinct"):
        LiberoAdapter.check_config(libero_cfg("libero_goal", perturbations=["task", "task"]))
    with pytest.raises(ConfigError, match=r"^perturbations: LIBERO-PRO perturbs libero_spatial, libero_object, "
                                          r"libero_goal, libero_10, not libero_90$"):
        LiberoAdapter.check_config(libero_cfg("libero_90", perturbations=["language"]))


@pytest.mark.slow
def test_one_task_of_every_perturbed_suite_builds_and_steps():
    """Perturbed scenes build: a task of two of the scene-changing families (object, position, task) per base suite,
    every family on two or three of the four suites, is built, reset into its initial state 7 (the state's length is
    the scene's: the variants have the bodies and joints the states were sampled with), and steps a chunk without
    the objects flying off. The language family keeps the base suite's scenes (only the instruction differs: checked
    above from the BDDL files), which tests/envs/test_libero.py builds."""
    scene_families = [f for f in pro.FAMILIES if f != "language"]
    for i, base in enumerate(pro.BASE_SUITES):
        env = LiberoSimEnv(libero_cfg(base, perturbations=list(pro.FAMILIES), image_size=[64, 64],
                                      max_cached_tasks=1), seed=0)
        try:
            for family in (scene_families[(2 * i) % 3], scene_families[(2 * i + 1) % 3]):
                j = list(pro.FAMILIES).index(family)        # the family's block of 10 global task ids
                task = j * 10 + (4 * i + j) % 10
                obs = env.reset(task, 7)
                sim = env.libero_env.env.sim
                assert env.libero_env.get_sim_state().shape == env.suite.init_states(task)[7].shape
                before = np.array(sim.data.qpos)
                result = env.step_chunk(noop_chunk())
                moved = np.abs(np.array(sim.data.qpos) - before).max()
                assert result.steps == 8 and np.all(np.isfinite(result.obs["state"])), (base, family)
                assert moved < 0.05, f"{base} {family} task {task}: the scene moved {moved:.3f} under a no-op chunk"
                assert obs["images"].std() > 5.0
        finally:
            env.close()


@pytest.mark.slow
def test_eval_scores_each_perturbation_through_the_cli(tmp_path):
    """`embodirl eval env=libero_object_pro`: one sweep over the suite's task 0 unperturbed and under two perturbations
    (the instruction's and the objects'; every family's scenes are built above), scored per perturbation (per_suite)
    with Wilson intervals in eval_info.json and the console table."""
    from tests import cli_runs

    out = tmp_path / "outputs" / "pro"
    args = ["eval", "env=libero_object_pro", "model=openvla_oft_tiny", "cluster.use_ray=false",
            "env.eval.perturbations=[none,language,object]", "env.eval.task_ids=[0]",
            "env.train.task_ids=[0]", "runner.eval_episodes_per_task=1", "env.eval.num_envs=1",
            "env.eval.max_episode_steps=8", "env.eval.image_size=[64,64]", "runner.eval_num_videos=0",
            "runner.progress_bar=false", "runner.logger.tensorboard=false", f"runner.output_dir={out}"]
    proc = cli_runs.run(args, tmp_path, env={**os.environ, "COLUMNS": "220"})   # the table unwrapped
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    info = json.loads(next(out.rglob("eval_info.json")).read_text())
    suites = ["libero_object", "libero_object_lan", "libero_object_object"]
    assert sorted(info["per_suite"]) == suites
    assert [(t["suite"], t["task_id"]) for t in info["per_task"]] == list(zip(suites, [0, 10, 20]))
    for row in info["per_suite"].values():
        assert row["n_episodes"] == 1 and len(row["success_rate_ci95"]) == 2
    assert info["per_task"][1]["task"] == "grab alphabet soup and put it into basket"
    for suite in suites:
        assert suite in proc.stdout
