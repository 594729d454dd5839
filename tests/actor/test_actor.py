"""The single-process actor: the update equals a hand-written full-batch step, micro-batching and
invalid decisions do not change it, weights are published by name, KL/reference, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor, prepare_batch
from embodirl.actor.optim import is_value_param
from embodirl.algorithms import losses
from embodirl.errors import ConfigError
from embodirl.models.state_policy import StateMLPPolicy

from .helpers import TASKS, TinyTokenPolicy, actor_cfg, grpo, ppo, token_batch


def published_after(policy, batch, cfg, **kwargs):
    actor = Actor(policy, cfg, task_table=TASKS, **kwargs)
    metrics = actor.step(batch)
    return actor, metrics, actor.publish_weights(full=True)[1]


def assert_same_state(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


@pytest.mark.parametrize("alg", [grpo(), ppo(update_epochs=1, kl_beta=0.05, entropy_bonus=0.01)],
                         ids=["grpo", "ppo"])
def test_update_equals_manual_full_batch_step(alg):
    """One optimizer step over 3 uneven micro-batches == the plain full-batch AdamW step."""
    policy = TinyTokenPolicy()
    reference = copy.deepcopy(policy)
    batch = token_batch(policy=policy)
    cfg = actor_cfg(alg, {"micro_batch_size": 3, "optim.clip_grad": 0.05, "optim.value_lr": 1e-3})
    actor = Actor(policy, cfg, task_table=TASKS)
    prepared, _ = actor.prepare(batch)
    metrics = actor.update(prepared)
    _, state = actor.publish_weights(full=True)

    # by hand: every valid decision in one forward, global normalisers, AdamW with two groups
    valid = prepared.get(D.VALID)
    n_idx, t_idx = valid.nonzero(as_tuple=True)
    obs = {D.IMAGES: prepared.get(D.IMAGES)[n_idx, t_idx], D.STATE: prepared.get(D.STATE)[n_idx, t_idx],
           D.TASK_ID: prepared.get(D.TASK_ID)[n_idx, t_idx], "instruction": ["x"] * len(n_idx)}
    use_critic = alg["adv_type"] == "gae"
    out = reference.score_actions(obs, prepared.get(D.ACTION_TOKENS)[n_idx, t_idx], return_value=use_critic)
    N, T, L = prepared.get(D.LOGPROB_BEHAVIOR).shape
    full = {k: v.new_zeros((N, T, *v.shape[1:])).index_put((n_idx, t_idx), v) for k, v in out.items()}
    params = actor.cfg.algorithm
    norms = losses.normalisers(valid, params, L=L, action_dim=3)
    with reference.reference_mode(), torch.no_grad():
        ref_out = reference.score_actions(obs, prepared.get(D.ACTION_TOKENS)[n_idx, t_idx], return_value=False,
                                     return_entropy=False)
    prepared.set(D.LOGPROB_REF, prepared.get(D.LOGPROB_BEHAVIOR).clone().index_put(
        (n_idx, t_idx), ref_out["logprob"]))
    loss, _ = losses.compute_loss(full, prepared, old_logprob=prepared.get(D.LOGPROB_BEHAVIOR), algorithm=params,
                                  norms=norms, action_dim=3, kl_coef=alg.get("kl_beta", 0.0))
    loss.backward()
    trainable = [(n, p) for n, p in reference.named_parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_([p for _, p in trainable if p.grad is not None], 0.05)
    opt = torch.optim.AdamW([{"params": [p for n, p in trainable if not is_value_param(n)], "lr": 3e-4},
                             {"params": [p for n, p in trainable if is_value_param(n)], "lr": 1e-3}],
                            betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt.step()
    assert metrics["actor/grad_norm"].item() == pytest.approx(grad_norm.item(), rel=1e-5)
    assert_same_state(state, {n: p.detach() for n, p in trainable})
    changed = [n for n in state if not torch.equal(state[n], dict(TinyTokenPolicy().named_parameters())[n])]
    assert changed, "the update changed nothing"


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_micro_batch_size_does_not_change_the_update(agg):
    batch = token_batch(policy=TinyTokenPolicy(), seed=3)
    results = []
    for micro in (1, 4):
        cfg = actor_cfg(ppo(loss_agg_func=agg, update_epochs=2), {"global_batch_size": 4, "micro_batch_size": micro})
        results.append(published_after(TinyTokenPolicy(), batch, cfg)[2])
    assert_same_state(*results)


def test_invalid_decisions_do_not_matter():
    batch = token_batch(policy=TinyTokenPolicy(), seed=4)
    invalid = ~batch.get(D.VALID)
    assert invalid.any()
    noisy = batch.clone()
    g = torch.Generator().manual_seed(0)
    for key in (D.STATE, D.LOGPROB_BEHAVIOR):
        x = noisy.get(key)
        x[invalid] = torch.randn(x[invalid].shape, generator=g) * 100
    noisy.get(D.ACTION_TOKENS)[invalid] = 0
    noisy.get(D.IMAGES)[invalid] = 255
    noisy.get(D.REWARD)[invalid] = 1e6
    cfg = actor_cfg(ppo(), {"micro_batch_size": 3})
    a = published_after(TinyTokenPolicy(), batch, cfg)[2]
    b = published_after(TinyTokenPolicy(), noisy, cfg)[2]
    assert_same_state(a, b, rtol=0, atol=0)


def test_publish_weights_names_only_changed_tensors():
    policy = TinyTokenPolicy()
    actor = Actor(policy, actor_cfg(grpo()), task_table=TASKS)
    version, state = actor.publish_weights()
    assert version == 0 and state == {}
    actor.step(token_batch(policy=policy))
    version, state = actor.publish_weights()
    assert version == 1
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    # GRPO trains no critic: the value head is trainable but unchanged, so it is not published
    assert set(state) == {n for n in trainable if not n.startswith("value_head")}
    assert all(t.device.type == "cpu" and not t.requires_grad for t in state.values())
    assert actor.publish_weights() == (1, {})
    # a inference copy that loads the published tensors acts like the actor's policy
    rollout = TinyTokenPolicy()
    rollout.load_trainable_state_dict(state)
    batch = token_batch(seed=9)
    obs = {D.IMAGES: batch.get(D.IMAGES)[:, 0], D.STATE: batch.get(D.STATE)[:, 0],
           D.TASK_ID: batch.get(D.TASK_ID)[:, 0], "instruction": ["x"] * 8}
    with torch.no_grad():
        ours = rollout.score_actions(obs, batch.get(D.ACTION_TOKENS)[:, 0])["logprob"]
        theirs = policy.score_actions(obs, batch.get(D.ACTION_TOKENS)[:, 0])["logprob"]
    torch.testing.assert_close(ours, theirs)


def state_policy_and_batch(N=8, T=3, seed=0):
    policy = StateMLPPolicy(4, 2, 2, hidden_sizes=(16,), critic_hidden_sizes=(16,))
    g = torch.Generator().manual_seed(seed)
    valid = torch.ones(N, T, dtype=torch.bool)
    valid[1, 2:] = False
    obs = {D.STATE: torch.randn(N * T, 4, generator=g)}
    torch.manual_seed(seed)
    with torch.no_grad():
        from embodirl.models.base import SamplingParams

        act = policy.act(obs, SamplingParams(), return_value=True)
    batch = D.make_trajectory({
        D.STATE: obs[D.STATE].view(N, T, 4), D.TASK_ID: torch.zeros(N, dtype=torch.int64),
        D.ACTION_SAMPLE: act[D.ACTION_SAMPLE].view(N, T, 4), D.ACTION_CHUNK: act[D.ACTION_CHUNK].view(N, T, 2, 2),
        D.LOGPROB_BEHAVIOR: act[D.LOGPROB_BEHAVIOR].view(N, T, 4), D.VALUE: act[D.VALUE].view(N, T),
        D.REWARD: torch.randn(N, T, generator=g), D.VALID: valid,
        D.TERMINATED: torch.zeros(N, T, dtype=torch.bool), D.TRUNCATED: torch.zeros(N, T, dtype=torch.bool),
    })
    return policy, batch


def test_value_lr_groups_and_warmup_schedule():
    policy, batch = state_policy_and_batch()
    cfg = actor_cfg(ppo(update_epochs=2), {"global_batch_size": 4, "optim.lr": 1e-3, "optim.value_lr": 5e-3,
                                             "optim.warmup_steps": 3})
    actor = Actor(policy, cfg, task_table=[])
    groups = {g["name"]: g for g in actor.optimizer.param_groups}
    names = {id(p): n for n, p in policy.named_parameters()}
    assert {names[id(p)].split(".")[0] for p in groups["value"]["params"]} == {"critic"}
    assert {names[id(p)].split(".")[0] for p in groups["policy"]["params"]} == {"actor", "log_std"}
    lrs = []
    for _ in range(2):
        metrics = actor.step(batch)
        lrs.append((metrics["actor/lr_policy"].item(), metrics["actor/lr_value"].item()))
    # 4 optimizer steps per update: lr ramps 1/3, 2/3, 1, 1 of its value (metrics average the steps)
    assert lrs[0][0] == pytest.approx(1e-3 * (1 / 3 + 2 / 3 + 1 + 1) / 4)
    assert lrs[0][1] == pytest.approx(5e-3 * (1 / 3 + 2 / 3 + 1 + 1) / 4)
    assert lrs[1] == pytest.approx((1e-3, 5e-3))
    assert actor.optimizer_steps == 8 and actor.version == 2


@pytest.mark.parametrize("kind, expected", [("linear", [1.0, 0.8125, 0.625, 0.4375, 0.25]),
                                              ("cosine", [1.0, 0.8535534, 0.5, 0.1464466, 0.0])])
def test_lr_decays_over_training_steps_and_resumes(kind, expected):
    """The decay counts actor updates (not optimizer steps) and is restored with the actor's
    state: an actor loaded after two updates continues the same schedule."""
    policy, batch = state_policy_and_batch()
    over = {"global_batch_size": 4, "optim.lr": 1e-3, "optim.lr_schedule": kind, "optim.lr_decay_steps": 4,
            "optim.min_lr_ratio": 0.25 if kind == "linear" else 0.0}
    cfg = actor_cfg(ppo(update_epochs=2), over)
    actor = Actor(policy, cfg, task_table=[])
    seen = [actor.step(batch)["actor/lr_policy"].item() for _ in range(2)]
    resumed = Actor(copy.deepcopy(policy), cfg, task_table=[])
    resumed.load_state_dict(actor.state_dict())
    seen += [resumed.step(batch)["actor/lr_policy"].item() for _ in range(3)]
    # linear keeps its 0.25 floor past the decay steps; every optimizer step of an update uses one lr
    assert seen == pytest.approx([1e-3 * f for f in expected], rel=1e-6)


def test_early_stop_kl_stops_the_update_early():
    policy, batch = state_policy_and_batch()
    base = {"global_batch_size": 2, "optim.lr": 0.05}
    full = Actor(copy.deepcopy(policy), actor_cfg(ppo(update_epochs=6), base), task_table=[]).step(batch)
    assert full["actor/optimizer_steps"].item() == 24  # 8 rows / 2 per step x 6 epochs
    assert full["actor/early_stopped"].item() == 0
    stopping = Actor(copy.deepcopy(policy), actor_cfg(ppo(update_epochs=6, early_stop_kl=1e-4), base), task_table=[])
    out = stopping.step(batch)
    steps = out["actor/optimizer_steps"].item()
    # the first step's KL is 0 (nothing changed yet), so at least two steps run; a large lr stops it soon
    assert 2 <= steps < 24 and out["actor/early_stopped"].item() == 1
    assert stopping.optimizer_steps == steps
    assert out["actor/decisions"].item() == pytest.approx(batch.get(D.VALID).sum().item() * steps / 4)


@pytest.mark.parametrize("over, key", [({"optim.lr_schedule": "step"}, "actor.optim.lr_schedule"),
                                       ({"optim.lr_schedule": "linear", "optim.lr_decay_steps": None},
                                        "actor.optim.lr_decay_steps"),
                                       ({"optim.min_lr_ratio": 1.5}, "actor.optim.min_lr_ratio")])
def test_bad_schedule_settings_name_their_key(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        Actor(StateMLPPolicy(state_dim=4, action_dim=2, action_chunk=1), actor_cfg(ppo(), over), task_table=[])


def test_bad_early_stop_kl_names_its_key():
    with pytest.raises(ConfigError, match=r"algorithm\.early_stop_kl"):
        Actor(StateMLPPolicy(state_dim=4, action_dim=2, action_chunk=1), actor_cfg(ppo(early_stop_kl=0.0)),
                task_table=[])


def test_reference_log_probs_and_kl_loss():
    policy = TinyTokenPolicy()
    batch = token_batch(policy=policy, seed=5)
    cfg = actor_cfg(ppo(kl_beta=0.5, kl_penalty="mse", **{"kl_ctrl.type": "adaptive", "kl_ctrl.target_kl": 1e-4,
                                                              "kl_ctrl.horizon": 16}),
                      {"optim.lr": 0.05, "micro_batch_size": 3})
    actor = Actor(policy, cfg, task_table=TASKS)
    with_ref = actor.compute_ref_logprob(batch)
    valid = batch.get(D.VALID)
    # lora_b starts at 0: the reference equals the policy before any update
    torch.testing.assert_close(with_ref.get(D.LOGPROB_REF)[valid], batch.get(D.LOGPROB_BEHAVIOR)[valid],
                               rtol=1e-5, atol=1e-5)
    actor.step(batch)
    metrics = actor.step(token_batch(policy=policy, seed=6))
    assert metrics["actor/kl"] > 0 and metrics["actor/kl_loss"] > 0
    # the measured KL exceeds the tiny target: the adaptive coefficient grew
    assert actor.kl_coef > 0.5
    after = actor.compute_ref_logprob(batch).get(D.LOGPROB_REF)
    torch.testing.assert_close(after, with_ref.get(D.LOGPROB_REF))  # the reference does not train


def test_kl_reward_penalty_reaches_advantages():
    policy = TinyTokenPolicy()
    batch = token_batch(policy=policy, seed=7)
    batch.set(D.LOGPROB_REF, batch.get(D.LOGPROB_BEHAVIOR) - 0.1)
    alg = actor_cfg(grpo(kl_beta=0.2, use_kl_loss=False, kl_penalty="kl"))["algorithm"]
    plain, _ = prepare_batch(batch, {**alg, "kl_beta": 0.0}, kl_coef=0.0)
    penalised, metrics = prepare_batch(batch, alg, kl_coef=0.2)
    assert metrics["kl/reward_penalty_kl"].item() == pytest.approx(0.1, rel=1e-4)
    valid = batch.get(D.VALID)
    expected = batch.get(D.REWARD) - 0.2 * 0.1 * 6 * valid
    torch.testing.assert_close(penalised.get(D.REWARD), expected)
    assert not torch.equal(plain.get(D.ADVANTAGE), penalised.get(D.ADVANTAGE))


def test_group_filtering_masks_uninformative_groups():
    policy = TinyTokenPolicy()
    batch = token_batch(policy=policy, seed=8)
    success = batch.get(D.SUCCESS)
    success[:4] = batch.get(D.VALID)[:4]   # group 0: all succeed
    success[4:] = False
    success[4, 0] = True                   # group 1: one of four
    cfg = actor_cfg(grpo(**{"filter_groups.enable": True}))
    actor = Actor(policy, cfg, task_table=TASKS)
    prepared, metrics = actor.prepare(batch)
    assert metrics["filter/kept_fraction"].item() == 0.5
    # what the groups could teach, counted before the filter
    assert {k: metrics[f"groups/{k}"].item() for k in ("all_fail", "mixed", "all_success")} == \
        {"all_fail": 0.0, "mixed": 0.5, "all_success": 0.5}
    assert not prepared.get(D.VALID)[:4].any()
    assert (prepared.get(D.ADVANTAGE)[:4] == 0).all()
    out = actor.update(prepared)
    assert out["actor/decisions"].item() == prepared.get(D.VALID).sum().item()


def test_stale_rows_use_proximal_log_probs():
    """Rows made by an older weight version are clipped against the current policy (ratio 1 at the
    first step whatever the stored behaviour log-probs) and weighted by pi_prox / pi_behaviour."""
    policy = TinyTokenPolicy()
    batch = token_batch(seed=10)  # random behaviour log-probs: far from the policy's
    cfg = actor_cfg(grpo(), {"replay_buffer.reuse_last_k": 1, "replay_buffer.max_staleness": 2})
    actor = Actor(policy, cfg, task_table=TASKS)
    prepared, _ = actor.prepare(batch)
    fresh = actor.update(prepared)
    assert fresh["actor/clip_fraction"] > 0  # random behaviour log-probs: ratios far from 1
    stale = prepared.clone()
    stale.set(D.WEIGHT_VERSION, torch.zeros(8, 4, dtype=torch.int64))  # actor is at version 1 now
    metrics = actor.update(stale)
    assert metrics["actor/ratio"].item() == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/clip_fraction"].item() == 0.0


def test_state_dict_round_trip():
    batch = token_batch(policy=TinyTokenPolicy(), seed=11)
    cfg = actor_cfg(ppo(kl_beta=0.1), {"micro_batch_size": 4})
    a = Actor(TinyTokenPolicy(), cfg, task_table=TASKS)
    a.step(batch)
    state = a.state_dict()
    b = Actor(TinyTokenPolicy(), cfg, task_table=TASKS)
    b.load_state_dict(state)
    assert b.version == 1 and b.optimizer_steps == a.optimizer_steps
    a.step(batch)
    b.step(batch)
    assert_same_state(a.publish_weights(full=True)[1], b.publish_weights(full=True)[1])


def test_full_finetune_trains_every_weight():
    policy = TinyTokenPolicy()
    actor = Actor(policy, actor_cfg(grpo(), {"fsdp.full_finetune": True}), task_table=TASKS)
    actor.step(token_batch(policy=TinyTokenPolicy(), seed=12))
    _, state = actor.publish_weights()
    assert "inp.weight" in state and "blocks.0.mix.base.weight" in state


def test_configuration_errors():
    policy = TinyTokenPolicy()
    cfg = actor_cfg(grpo())
    del cfg["algorithm"]["clip_ratio_c"]
    with pytest.raises(ConfigError, match="algorithm.clip_ratio_c"):
        Actor(policy, cfg, task_table=TASKS)
    state_policy, _ = state_policy_and_batch()
    with pytest.raises(ConfigError, match="kl_beta"):
        actor = Actor(state_policy, actor_cfg(ppo(kl_beta=0.1)), task_table=[])
        actor.compute_ref_logprob(state_policy_and_batch()[1])
    with pytest.raises(ConfigError, match="full_finetune"):
        Actor(policy, actor_cfg(grpo(kl_beta=0.1), {"fsdp.full_finetune": True}), task_table=TASKS)
    state_policy.value_type = None
    with pytest.raises(ConfigError, match="value head"):
        Actor(state_policy, actor_cfg(ppo()), task_table=[])
    with pytest.raises(ValueError, match="lacks"):
        Actor(TinyTokenPolicy(), actor_cfg(grpo()), task_table=TASKS).update(token_batch())


@pytest.mark.parametrize("logprob_type", ["token", "action"])
def test_action_level_rewards_and_values(logprob_type):
    """Per-action rewards [N, T, H] and an action-level critic [N, T, H] through the whole update."""
    torch.manual_seed(0)
    policy = StateMLPPolicy(4, 2, 2, hidden_sizes=(16,), critic_hidden_sizes=(16,), value_type="action_level")
    _, batch = state_policy_and_batch()
    N, T = batch.batch_size
    with torch.no_grad():
        values = policy.score_actions({D.STATE: batch.get(D.STATE).flatten(0, 1)}, batch.get(D.ACTION_SAMPLE).flatten(0, 1),
                                 return_entropy=False)[D.VALUE]
    batch.set(D.VALUE, values.view(N, T, 2))
    batch.set(D.REWARD, torch.randn(N, T, 2))
    cfg = actor_cfg(ppo(reward_type="action_level", logprob_type=logprob_type), {"micro_batch_size": 3})
    actor = Actor(policy, cfg, task_table=[])
    prepared, _ = actor.prepare(batch)
    assert prepared.get(D.ADVANTAGE).shape == (N, T, 2)
    metrics = actor.update(prepared)
    assert torch.isfinite(metrics["critic/value_loss"]) and torch.isfinite(metrics["critic/explained_variance"])
    assert {n.split(".")[0] for n in actor.publish_weights()[1]} == {"actor", "log_std", "critic"}


def test_bf16_model_keeps_fp32_master_weights_without_fsdp():
    """A single process without a process group (no FSDP): the trainable tensors of a bf16 model - LoRA
    and value head - are fp32 master weights, the frozen base keeps computing in bf16, and an update
    changes the fp32 values by less than bf16 could even represent."""
    from embodirl.models.openvla_oft import build_policy

    from .helpers import OFT_TASKS, _oft_model_cfg, oft_batch, oft_spec

    torch.manual_seed(0)
    policy = build_policy({**_oft_model_cfg(), "dtype": "bfloat16"}, oft_spec())
    actor = Actor(policy, actor_cfg(ppo(update_epochs=1), {"global_batch_size": 2, "micro_batch_size": 2,
                                                                "optim.lr": 1e-6}),
                      task_table=OFT_TASKS)
    assert not actor.use_fsdp
    trainable = dict(actor._trainable)
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    assert any("value_head" in n for n in trainable) and any("lora_" in n for n in trainable)
    frozen = [p for p in policy.parameters() if not p.requires_grad and p.is_floating_point()]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    before = {n: p.detach().clone() for n, p in trainable.items()}
    batch = oft_batch(policy, N=2, T=1, seed=3)
    actor.step(batch)
    moved = [n for n, p in trainable.items() if not torch.equal(p, before[n])]
    assert moved
    # at lr 1e-6 the steps are far below bf16's resolution: only fp32 masters keep them
    lora = next(n for n in moved if "lora_" in n)
    delta = (trainable[lora] - before[lora]).abs().max()
    assert 0 < delta < 1e-4
    assert not torch.equal(trainable[lora].to(torch.bfloat16).float(), trainable[lora])
