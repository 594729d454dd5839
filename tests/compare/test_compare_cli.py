"""``embodirl compare`` through the CLI on the toy task with the state policy: two checkpoints of one short training
run, step 2 (3 % success) and step 8 (81 %), compared on the same 32 evaluation episodes. The pairs are the episodes
each side's own ``embodirl eval`` plays, the trained side wins with a small p, swapping the sides swaps the report,
the sequential option stops early, and bad input is refused in one sentence before any worker starts."""

from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf

from tests import cli_runs

TOY = ["env=toy_reach", "env.train.state_obs=true", "env.eval.state_obs=true", "env.train.cameras=[]",
       "env.eval.cameras=[]", "env.train.num_envs=8", "env.eval.num_envs=8", "env.train.reward_mode=dense",
       "env.eval.reward_mode=dense", "runner.eval_episodes_per_task=8", "runner.eval_num_videos=0",
       "runner.progress_bar=false", "runner.logger.tensorboard=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A toy run trained for 8 steps with checkpoints at steps 2, 4, 6, 8 (about 10 s)."""
    root = tmp_path_factory.mktemp("compare")
    cli_runs.run(["train", *TOY, "actor.optim.lr=3e-3", "runner.max_steps=8", "runner.save_interval=2",
                  "runner.keep_last=null", "runner.val_check_interval=0", f"runner.output_dir={root / 'run'}"], root,
                 expect=0)
    return root / "run"


def compare(cwd, a, b, *args: str, out: str = "cmp"):
    proc = cli_runs.run(["compare", str(a), str(b), *TOY, *args, f"runner.output_dir={cwd / out}"], cwd, expect=0)
    return proc, json.loads((cwd / out / "compare_info.json").read_text())


def episodes(eval_info: dict) -> dict[int, dict]:
    return {e["episode_ix"]: e for e in eval_info["per_episode"]}


@pytest.fixture(scope="module")
def full(run_dir):
    """The whole sweep: A = step 2, B = step 8."""
    proc, info = compare(run_dir.parent, run_dir / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_8")
    return proc, info


def test_the_trained_checkpoint_wins_on_the_pairs_each_eval_plays(run_dir, full):
    proc, info = full
    cwd = run_dir.parent
    o = info["overall"]
    assert info["n_pairs"] == info["n_planned_pairs"] == o["n_pairs"] == 32
    assert o["b_only"] >= 15 and o["a_only"] <= 2 and o["p_value"] < 1e-4, o
    assert o["differs"] and o["better"] == "b" and o["difference_ci95"][0] > 0.3
    assert "B is better overall at alpha 0.05" in proc.stdout
    assert (info["a"]["kind"], info["a"]["step"], info["b"]["step"]) == ("run_checkpoint", 2, 8)
    assert info["a"]["weights_sha256"] != info["b"]["weights_sha256"]
    # the pairs are what each side's own eval_info.json says, episode by episode, and what `embodirl eval` of each
    # checkpoint says: the same evaluation
    sides = {s: episodes(json.loads((cwd / "cmp" / s / "eval_info.json").read_text())) for s in "ab"}
    for s, step in (("a", 2), ("b", 8)):
        cli_runs.run(["eval", *TOY, f"runner.resume_dir={run_dir / 'checkpoints' / f'step_{step}'}",
                      f"runner.output_dir={cwd / f'eval_{s}'}"], cwd, expect=0)
        alone = episodes(json.loads((cwd / f"eval_{s}" / "eval_info.json").read_text()))
        assert alone.keys() == sides[s].keys()
        for j, e in alone.items():
            assert (e["success"], e["length"], e["seed"]) == \
                (sides[s][j]["success"], sides[s][j]["length"], sides[s][j]["seed"]), (s, j)
    for pair in info["episodes"]:
        j = pair["episode_ix"]
        assert (pair["a_success"], pair["b_success"]) == (sides["a"][j]["success"], sides["b"][j]["success"])
        assert (pair["task_id"], pair["init_state_id"]) == (sides["a"][j]["task_id"], sides["a"][j]["init_state_id"])
    a_only = sum(sides["a"][j]["success"] and not sides["b"][j]["success"] for j in sides["a"])
    b_only = sum(sides["b"][j]["success"] and not sides["a"][j]["success"] for j in sides["a"])
    assert (o["a_only"], o["b_only"]) == (a_only, b_only)
    assert sum(r["b_only"] for r in info["per_task"]) == b_only and len(info["per_task"]) == 4
    assert all(r["p_holm"] >= r["p_value"] for r in info["per_task"])


def test_swapping_the_sides_swaps_the_report(run_dir, full):
    """A = step 8's weights as a policy file (model.path), B = step 2: the same episodes, the other winner."""
    _, before = full
    weights = run_dir / "checkpoints" / "step_8" / "policy" / "trainable.safetensors"
    proc, info = compare(run_dir.parent, weights, run_dir / "checkpoints" / "step_2", out="swapped")
    assert (info["a"]["kind"], info["a"]["step"]) == ("model_path", None)
    assert info["a"]["weights_sha256"] == before["b"]["weights_sha256"]      # the same tensors, the same digest
    assert [(e["b_success"], e["a_success"]) for e in info["episodes"]] == \
        [(e["a_success"], e["b_success"]) for e in before["episodes"]]
    o, p = info["overall"], before["overall"]
    assert (o["a_only"], o["b_only"], o["p_value"]) == (p["b_only"], p["a_only"], p["p_value"])
    assert o["better"] == "a" and o["difference"] == -p["difference"]
    assert "A is better overall" in proc.stdout


def test_the_sequential_option_stops_early_on_a_clear_difference(run_dir, full):
    _, whole = full
    proc, info = compare(run_dir.parent, run_dir / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_8",
                         "compare.sequential=true", "compare.looks=4", out="seq")
    seq = info["sequential"]
    assert seq["enabled"] and seq["stopped_early"] and seq["stopped_at_look"] < 4
    assert info["n_pairs"] == 8 * seq["stopped_at_look"] < info["n_planned_pairs"] == 32
    assert info["overall"]["better"] == "b" and "sequential test stopped at look" in proc.stdout
    last = seq["looks_run"][-1]
    assert last["stop"] and min(last["a_only"], last["b_only"]) <= last["boundary"]
    assert last["crossing_probability"] <= last["alpha_spent"] <= 0.05
    # every look held every task; the episodes run are the whole sweep's, with the same outcomes
    same = {e["episode_ix"]: e for e in whole["episodes"]}
    for e in info["episodes"]:
        assert (e["a_success"], e["b_success"]) == (same[e["episode_ix"]]["a_success"], same[e["episode_ix"]]["b_success"])
    assert {e["task_id"] for e in info["episodes"] if e["look"] == 1} == {0, 1, 2, 3}
    for s in "ab":
        eval_info = json.loads((run_dir.parent / "seq" / s / "eval_info.json").read_text())
        assert eval_info["overall"]["n_episodes"] == info["n_pairs"]


def test_a_side_names_a_policy_checkpoint_or_a_run_checkpoint(run_dir, tmp_path):
    """What each kind of path is taken as (no command run): a folder with config.json (an OpenVLA-OFT or SFT export)
    and a file load as model.path; a step folder, a run folder and its checkpoints/ folder as that run's checkpoint."""
    from embodirl.compare.compose import MODEL_PATH, RUN_CHECKPOINT, resolve_side

    model = tmp_path / "oft"
    model.mkdir()
    (model / "config.json").write_text("{}")
    step_8 = run_dir / "checkpoints" / "step_8"
    assert resolve_side("a", str(model)) == (model, MODEL_PATH, None)
    weights = step_8 / "policy" / "trainable.safetensors"
    assert resolve_side("a", str(weights)) == (weights, MODEL_PATH, None)
    for given in (step_8, run_dir, run_dir / "checkpoints"):
        assert resolve_side("b", str(given)) == (given, RUN_CHECKPOINT, step_8)
    assert resolve_side("a", str(run_dir / "checkpoints" / "step_2"))[2] == run_dir / "checkpoints" / "step_2"


def _refusals(run_dir, tmp_path):
    step_2, step_8 = run_dir / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_8"
    (tmp_path / "empty").mkdir()
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    other = tmp_path / "other" / "step_2"
    shutil.copytree(step_2, other)
    saved = OmegaConf.load(other / "config" / "config.yaml")
    saved.model.name = "openvla_oft_tiny"
    OmegaConf.save(saved, other / "config" / "config.yaml")
    return {
        "same path twice": ([step_2, step_2], "compare.b: names the same checkpoint as compare.a"),
        "a run folder and its latest step": ([run_dir, step_8], "compare.b: names the same checkpoint as compare.a"),
        "a missing folder": ([tmp_path / "nope", step_8], f"compare.a: {tmp_path / 'nope'} does not exist"),
        "a folder without a checkpoint": ([step_2, tmp_path / "empty"], "compare.b: "),
        "weights the model cannot load": ([garbage, step_8], f"compare.a: as model.path, {garbage} is not a "
                                                             "safetensors file"),
        "another model's checkpoint": ([other, step_8], "compare.a: "),
        "a training run's folder as output": ([step_2, step_8, f"runner.output_dir={run_dir}"],
                                              "runner.output_dir: "),
        "another comparison's folder": ([step_2, step_8, f"runner.output_dir={run_dir.parent / 'swapped'}"],
                                        "runner.output_dir: "),
        "one checkpoint": ([step_2], "compare.a: embodirl compare takes two checkpoints"),
        "a flag": ([step_2, step_8, "--cfg", "job"], "embodirl compare takes two checkpoints and Hydra overrides"),
        "sampled actions": ([step_2, step_8, "runner.eval_greedy=false"], "runner.eval_greedy: "),
        "a compare key that does not exist": ([step_2, step_8, "compare.alhpa=0.1"], "compare.alhpa: "),
        "alpha out of range": ([step_2, step_8, "compare.alpha=1.5"], "compare.alpha: "),
    }


def test_bad_input_is_refused_in_one_sentence_before_any_worker_starts(run_dir, tmp_path):
    step_8_weights = run_dir / "checkpoints" / "step_8" / "policy" / "trainable.safetensors"
    if not (run_dir.parent / "swapped" / "compare_info.json").is_file():       # this test run alone
        compare(run_dir.parent, step_8_weights, run_dir / "checkpoints" / "step_2", out="swapped")
    fragments = {"a folder without a checkpoint": "holds no checkpoint",
                 "another model's checkpoint": "is a checkpoint of model.name=openvla_oft_tiny",
                 "a training run's folder as output": "is a training run's folder",
                 "another comparison's folder": f"holds the comparison of {step_8_weights}"}
    for name, (args, start) in _refusals(run_dir, tmp_path).items():
        out = tmp_path / "refused"
        args = [str(a) for a in args]
        if not any(a.startswith("runner.output_dir=") for a in args):
            args.append(f"runner.output_dir={out}")
        proc = cli_runs.run(["compare", *args, *TOY], tmp_path)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, (name, proc.stderr[-2000:])
        assert lines[0].startswith(f"embodirl: {start}"), (name, lines[0])
        assert fragments.get(name, "") in lines[0], (name, lines[0])
        assert not out.exists(), name                     # nothing written, no worker started
    assert not (run_dir / "compare_info.json").exists()
