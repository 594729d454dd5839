"""The seed-sweep tool: ``scripts/seed_sweep.py`` runs ``embodirl train`` per seed and summarises when each first
reached the bar, whether it held, and the distribution, and draws the curves; the summariser on hand-made curves for
its edge cases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from embodirl.runner.seed_sweep import distribution, format_report, summarize_curve

ROOT = Path(__file__).resolve().parents[2]


def test_first_step_hold_and_distribution():
    reached_held = summarize_curve(1, [(10, 0.5, 0.2), (20, 1.0, 0.82), (30, 1.5, 0.76), (40, 2.0, 0.9)], 0.8, 0.75)
    dipped = summarize_curve(2, [(10, 0.5, 0.81), (20, 1.0, 0.7), (30, 1.5, 0.95)], 0.8, 0.75)
    never = summarize_curve(3, [(10, 0.5, 0.1), (20, 1.0, 0.79)], 0.8, 0.75)
    last = summarize_curve(4, [(10, 0.5, 0.1), (20, 1.0, 0.85)], 0.8, 0.75)
    assert (reached_held.first_step, reached_held.first_minutes, reached_held.held) == (20, 1.0, True)
    assert reached_held.lowest_after == 0.76 and reached_held.final == 0.9
    assert (dipped.first_step, dipped.held, dipped.lowest_after) == (10, False, 0.7)
    assert not never.reached and never.final == 0.79
    assert last.held and last.lowest_after is None           # reached at the last evaluation: nothing to hold
    d = distribution([reached_held, dipped, never, last])
    assert (d["reached"], d["reached_and_held"]) == (3, 2)
    assert d["median_first_step"] == 20 and d["worst_first_step"] is None       # one seed never reached it
    assert "reached 3/4, reached and held 2/4" in format_report([reached_held, dipped, never, last], 0.8, 0.75)


def test_the_script_runs_each_seed_and_resumes(tmp_path):
    args = [sys.executable, str(ROOT / "scripts" / "seed_sweep.py"), "--seeds", "1-2", "--out", str(tmp_path / "sweep"),
            "--bar", "0.5", "--hold", "0.4", "--start", "0.1", "--title", "toy_reach", "env=toy_reach",
            "env.train.state_obs=true", "env.eval.state_obs=true",
            "env.train.cameras=[]", "env.eval.cameras=[]", "env.train.reward_mode=dense", "env.eval.reward_mode=dense",
            "runner.max_steps=4", "runner.val_check_interval=2", "runner.eval_episodes_per_task=2",
            "runner.eval_num_videos=0", "runner.save_interval=0", "runner.logger.tensorboard=false"]
    proc = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "seed | first step >= bar" in proc.stdout and "reached" in proc.stdout.splitlines()[-1]
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert [s["seed"] for s in summary["seeds"]] == [1, 2]
    assert all([step for step, _, _ in s["curve"]] == [2, 4] for s in summary["seeds"])
    assert (tmp_path / "sweep" / "seed_1.log").is_file()
    assert (tmp_path / "sweep" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)   # finished seeds are kept
    assert again.returncode == 0 and again.stdout.count("already done") == 2


def test_a_rate_outside_zero_to_one_is_one_sentence(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "seed_sweep.py"), "--summarize", "--out",
                           str(tmp_path / "sweep"), "--start", "4.5"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--start is 4.5; give a success rate between 0 and 1" in proc.stderr
    assert not (tmp_path / "sweep").exists()
