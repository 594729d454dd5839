import pickle

import pytest
import torch

from embodirl import data as D


def _traj(N=4, T=3, H=2, A=7, V=2, L=None):
    L = L or H * A
    g = torch.Generator().manual_seed(0)
    return D.make_trajectory({
        D.IMAGES: torch.randint(0, 255, (N, T, V, 3, 8, 8), dtype=torch.uint8, generator=g),
        D.STATE: torch.randn(N, T, 8, generator=g),
        D.TASK_ID: torch.arange(N),
        D.ACTION_TOKENS: torch.randint(0, 32000, (N, T, L), generator=g),
        D.ACTION_CHUNK: torch.randn(N, T, H, A, generator=g),
        D.LOGPROB_BEHAVIOR: torch.randn(N, T, L, generator=g),
        D.REWARD: torch.randn(N, T, generator=g),
        D.TERMINATED: torch.zeros(N, T, dtype=torch.bool),
        D.TRUNCATED: torch.zeros(N, T, dtype=torch.bool),
        D.VALID: torch.ones(N, T, dtype=torch.bool),
        D.GROUP_ID: torch.arange(N) // 2,
    }, extras={D.BOOTSTRAP_VALUE: torch.randn(N, generator=g)})


def test_valid_trajectory_binds_symbols():
    traj = _traj()
    assert D.validate(traj) == {"V": 2, "C": 3, "h": 8, "w": 8, "S": 8, "L": 14, "H": 2, "A": 7}
    assert traj[D.TASK_ID].shape == (4, 3)  # per-episode field broadcast over T
    assert D.get_extra(traj, D.BOOTSTRAP_VALUE).shape == (4,)


def test_split_concat_roundtrip_and_pickle():
    traj = _traj(N=6)
    parts = D.split(traj, 2)
    assert [p.batch_size[0] for p in parts] == [2, 2, 2]
    back = D.concat(list(parts))
    assert (back == traj).all()
    restored = pickle.loads(pickle.dumps(traj))
    assert (restored == traj).all()
    assert torch.equal(D.get_extra(parts[1], D.BOOTSTRAP_VALUE), D.get_extra(traj, D.BOOTSTRAP_VALUE)[2:4])


@pytest.mark.parametrize("mutate, field", [
    (lambda td: td.set(D.REWARD, td[D.REWARD].double()), "reward"),
    (lambda td: td.set(D.ACTION_CHUNK, torch.zeros(*td.batch_size, 3)), "action_chunk"),
    (lambda td: td.set(D.LOGPROB_BEHAVIOR, torch.zeros(*td.batch_size, 5)), "logprob_behavior"),
    (lambda td: td.del_(D.VALID), "valid"),
    (lambda td: td.set("meta_info", torch.zeros(*td.batch_size)), "meta_info"),
    (lambda td: td.set(D.IMAGES, td[D.IMAGES].float()), "images"),
])
def test_validate_names_offending_field(mutate, field):
    traj = _traj()
    mutate(traj)
    with pytest.raises(D.TrajectoryError, match=f"'{field}'"):
        D.validate(traj)


def test_action_level_reward_shape_accepted_and_checked():
    traj = _traj()
    traj.set(D.REWARD, torch.zeros(4, 3, 2))  # [N, T, H] with H=2 from action_chunk
    D.validate(traj)
    traj.set(D.REWARD, torch.zeros(4, 3, 5))  # H mismatch
    with pytest.raises(D.TrajectoryError, match="reward"):
        D.validate(traj)


@pytest.mark.parametrize("args", [["--cfg", "job"], ["env.train.reward_coef=nan"]])
def test_config_only_cli_runs_do_not_import_tensordict(tmp_path, args):
    """`embodirl train --cfg job` and a refusal read the schema (which names this module's fields) and stop before any
    batch exists: they must not pay for tensordict's import, which imports torch._dynamo (0.80x the wall time of
    `--cfg job` without it, measured whole-process against the eager import)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "embodirl.cli", "train", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == (0 if args[0] == "--cfg" else 2), proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "embodirl.schema" in imported                       # the config path ran
    assert "tensordict" not in imported and "torch._dynamo" not in imported
    assert isinstance(_traj(), D.TensorDict)                   # the module attribute still resolves, on first use
