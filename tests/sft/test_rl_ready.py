"""The RL-ready check (autoconfig.check_run): token RL from a checkpoint whose action tokens were never trained is
refused in one sentence that names `embodirl sft`; the `action_tokens_trained` record `embodirl sft` writes
into config.json lets RL start (acting through the tokens), and a `false` record is refused."""

from __future__ import annotations

import json
import shutil

import pytest

from embodirl.config import compose, validate
from embodirl.errors import ConfigError
from embodirl.models.openvla_oft.hf_checkpoint import MARKER, TOKENS_TRAINED
from tests.models.test_openvla_checkpoint import direct_model, oft_action_head_file, one_sentence, write_public_checkpoint

TINY_LIBERO = ["env=libero_10", "model=openvla_oft_tiny", "env.train.image_size=[64,64]",
               "env.eval.image_size=[64,64]"]
GRPO = ["algorithm=grpo", "env.train.use_fixed_reset_state_ids=true", "algorithm.group_size=2",
        "env.train.num_envs=2", "actor.global_batch_size=2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An L1-only OFT checkpoint, and copies of it marked as `embodirl sft` marks its exports."""
    root = tmp_path_factory.mktemp("rl_ready")
    model = direct_model(seed=3)
    l1 = write_public_checkpoint(root / "l1", model)
    oft_action_head_file(l1, model.cfg.llm_dim, 7)
    out = {"l1": l1}
    for name, trained, head in (("both", True, True), ("untrained_tokens", False, False)):
        path = root / name
        shutil.copytree(l1, path)
        if not head:
            for f in path.glob("action_head--*"):
                f.unlink()
        config = json.loads((path / "config.json").read_text())
        config.setdefault(MARKER, {})[TOKENS_TRAINED] = trained
        (path / "config.json").write_text(json.dumps(config))
        out[name] = path
    return out


def _validate(path, *extra):
    validate(compose([*TINY_LIBERO, f"model.path={path}", *GRPO, *extra]), num_devices=2, accelerator="cpu")


def test_an_l1_only_checkpoint_is_refused_naming_embodirl_sft(checkpoints):
    with pytest.raises(ConfigError) as exc:
        _validate(checkpoints["l1"])
    message = one_sentence(exc)
    assert exc.value.key == "model.path"
    assert "never trained" in message and "`embodirl sft " in message and "embodirl eval" in message, message


def test_trained_tokens_with_an_l1_head_need_the_token_policy(checkpoints):
    with pytest.raises(ConfigError) as exc:
        _validate(checkpoints["both"])
    assert exc.value.key == "model.use_l1_regression" and "=false" in one_sentence(exc)
    _validate(checkpoints["both"], "model.use_l1_regression=false")     # RL over the trained tokens: accepted


def test_a_checkpoint_recording_untrained_tokens_is_refused(checkpoints):
    with pytest.raises(ConfigError) as exc:
        _validate(checkpoints["untrained_tokens"])
    message = one_sentence(exc)
    assert exc.value.key == "model.path" and "never trained" in message and "`embodirl sft " in message, message
    # evaluation of it is fine
    validate(compose([*TINY_LIBERO, f"model.path={checkpoints['untrained_tokens']}", "runner.only_eval=true"]),
             num_devices=2, accelerator="cpu")
