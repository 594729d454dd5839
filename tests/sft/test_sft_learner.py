"""The SFT step of the actor (``Actor.sft_update`` through the actor group): OpenVLA-OFT's token loss on
a fixed batch falls and action-token accuracy rises (overfit at CPU size); the L1 head option trains the
continuous head; the statistics set on the ranks reach the exported checkpoint."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from embodirl.envs.base import EnvSpec
from embodirl.models.openvla_oft.hf_checkpoint import MARKER, TOKENS_TRAINED
from embodirl.schema import run_config
from embodirl.workers.actor_group import ActorGroup

SPEC = EnvSpec(action_dim=4, max_episode_steps=16, task_descriptions=["push the cube"], camera_names=["base"],
               image_size=(56, 56), state_dim=5, name="test")
H = 2


def _cfg(compose_cfg, *extra):
    cfg = compose_cfg("model=openvla_oft_tiny", f"model.action_chunk={H}", "actor.optim.lr=3e-3",
                      "model.lora.target_modules=[all-linear,lm_head]", *extra)
    return cfg


def _batch(n=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"images": rng.integers(0, 255, (n, 1, 3, 56, 56), dtype=np.uint8),
            "state": rng.normal(size=(n, 5)).astype(np.float32),
            "instruction": ["push the cube"] * n,
            "actions": rng.uniform(-1, 1, (n, H, 4)).astype(np.float32)}


@pytest.mark.slow
def test_token_loss_falls_and_accuracy_rises_on_a_fixed_batch(compose_cfg, tmp_path):
    """40 steps on 4 random samples (8 action tokens each, 256 bins): ~45 s on a loaded 2-core machine."""
    torch.manual_seed(0)
    actors = ActorGroup.local(_cfg(compose_cfg), SPEC)
    batch = _batch()
    history = [actors.sft_train(batch, {"micro_batch_size": 4}) for _ in range(40)]
    first, last = history[0], history[-1]
    assert last["sft/loss"] < 0.25 * first["sft/loss"], (first["sft/loss"], last["sft/loss"])
    assert last["sft/token_accuracy"] >= 0.25, last["sft/token_accuracy"]
    assert last["sft/token_accuracy"] > first["sft/token_accuracy"] + 0.1
    assert last["actor/version"] == 40.0
    # the exported checkpoint is marked as having trained action tokens and carries the statistics
    stats = {"test": {"action": {"q01": [-1.0] * 4, "q99": [1.0] * 4, "mask": [True] * 4},
                      "proprio": {"q01": [-2.0] * 5, "q99": [2.0] * 5, "mask": [True] * 5}}}
    actors.set_statistics(stats)
    actors.export(tmp_path / "ckpt", 25, {TOKENS_TRAINED: True})
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config[MARKER][TOKENS_TRAINED] is True
    assert json.loads((tmp_path / "ckpt" / "dataset_statistics.json").read_text()) == stats
    actors.close()


def _gradients_at_step(actor) -> dict:
    """A dict that the actor's optimizer fills, at each step, with the gradients it is about to apply."""
    names = {id(p): n for n, p in actor.policy.named_parameters()}
    grads: dict = {}

    def capture(optimizer, args, kwargs):
        grads.update({names[id(p)]: p.grad.detach().clone() for group in optimizer.param_groups
                      for p in group["params"] if p.grad is not None})

    actor.optimizer.register_step_pre_hook(capture)
    return grads


def test_micro_batches_give_the_full_batch_gradient(compose_cfg):
    """Two micro-batches of 2 and one of 4 give the optimizer the same gradient (sums over the global label
    count). Compared are the gradients the optimizer step receives (captured by a step pre-hook), not the
    weights after it: Adam divides by a gradient's own magnitude, so a rounding difference in a near-zero
    gradient becomes a step-sized difference in the weights on some CPUs."""
    results = []
    for micro in (2, 4):
        torch.manual_seed(0)
        # no clipping: it would rescale both gradients to one norm and hide a wrong normaliser
        actors = ActorGroup.local(_cfg(compose_cfg, "actor.optim.clip_grad=null"), SPEC)
        grads = _gradients_at_step(actors.workers[0].actor)
        metrics = actors.sft_train(_batch(), {"micro_batch_size": micro})
        results.append((metrics, grads))
        actors.close()
    (m2, g2), (m4, g4) = results
    assert m2["sft/loss"] == pytest.approx(m4["sft/loss"], rel=1e-5)
    assert sorted(g2) == sorted(g4) and len(g2) > 10
    scale = max(float(g.abs().max()) for g in g4.values())
    for name in g4:
        # float32 sums in another order: relative to each tensor, with a floor relative to the largest gradient
        torch.testing.assert_close(g2[name], g4[name], rtol=1e-4, atol=1e-5 * scale,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_sliced_vocabulary_loss_equals_one_pass_over_the_whole_vocabulary(compose_cfg, monkeypatch):
    """``supervised`` computes OFT's whole-vocabulary cross-entropy over slices of rows (a CPU allocator maps a
    whole batch's logits afresh each step): its sum, its greedy tokens and the LM head's gradient are those of
    one pass over all the logits. Slices of 3 rows here, so that the 32 action rows and the 4 stop rows span
    several slices, the last ones partial."""
    import torch.nn.functional as F

    from embodirl.models.openvla_oft import policy as oft_policy

    torch.manual_seed(0)
    actors = ActorGroup.local(_cfg(compose_cfg, "actor.fsdp.full_finetune=true"), SPEC)   # the head trains
    policy = actors.workers[0].actor.policy
    head = policy.core.language_model.lm_head
    batch = _batch()
    obs = {k: batch[k] for k in ("images", "state", "instruction")}
    actions = torch.as_tensor(batch["actions"])
    vocab = head.weight.shape[0]
    monkeypatch.setattr(oft_policy, "CE_SLICE_BYTES", 3 * 4 * vocab)
    sliced = policy.supervised(obs, actions)
    (grad_sliced,) = torch.autograd.grad(sliced["ce_sum"], head.weight)

    out = policy.core(**policy.prepare_inputs(obs))
    tok = policy.action_tokenizer
    labels = tok.encode(actions.reshape(len(actions), -1))
    logits = head(torch.cat([out.action_hidden.flatten(0, 1), out.stop_hidden])).float()
    targets = torch.cat([labels.reshape(-1), torch.full((len(actions),), 2)])      # </s> is Llama's id 2
    reference = F.cross_entropy(logits, targets, reduction="sum")
    (grad_reference,) = torch.autograd.grad(reference, head.weight)
    torch.testing.assert_close(sliced["ce_sum"], reference, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_sliced, grad_reference, rtol=1e-4, atol=1e-6 * float(grad_reference.abs().max()))
    greedy = logits[: labels.numel()].argmax(-1).clamp(tok.first_id, tok.end_id - 1).reshape(labels.shape)
    assert float(sliced["correct"]) == float((greedy == labels).sum())
    actors.close()


def test_l1_head_option_trains_the_regression_head_and_marks_untrained_tokens(compose_cfg, tmp_path):
    """sft.l1_head without the token loss (OFT's L1 recipe): the L1 loss falls, the export has the head and
    records untrained tokens, and token RL from it is refused naming embodirl sft."""
    from embodirl.errors import ConfigError
    from embodirl.models.openvla_oft.autoconfig import check_run

    torch.manual_seed(0)
    cfg = _cfg(compose_cfg, "model.use_l1_regression=true",
               "model.lora.modules_to_save=[value_head,proprio_projector,action_head]")
    actors = ActorGroup.local(cfg, SPEC)
    options = {"micro_batch_size": 4, "token_loss": False, "l1_head": True}
    history = [actors.sft_train(_batch(), options)["sft/l1_head_loss"] for _ in range(15)]
    assert history[-1] < 0.85 * history[0], history
    actors.export(tmp_path / "l1", 8, {TOKENS_TRAINED: False})
    actors.close()
    assert list((tmp_path / "l1").glob("action_head--8_checkpoint.pt"))
    run = run_config(cfg)       # token RL (grpo) from the export, with use_l1_regression left to the checkpoint
    run = dataclasses.replace(run, model=dataclasses.replace(run.model, use_l1_regression=None),
                              runner=dataclasses.replace(run.runner, only_eval=False),
                              algorithm=dataclasses.replace(run.algorithm, adv_type="grpo"))
    with pytest.raises(ConfigError, match="embodirl sft"):
        check_run(run, str(tmp_path / "l1"))
