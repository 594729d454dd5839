"""The actor's moving average of its weights (``actor.ema_decay``): after k updates of real toy-task batches each
moved tensor is the ``decay``-power-weighted sum of the weights after every update, the state normaliser's
statistics (parameters no gradient reaches) stay the current ones, and the swap evaluation uses puts the average into
the module and back exactly (the statistics stay). Through the CLI: ``tests/runner/test_ema.py``."""

from __future__ import annotations

import torch

from embodirl.actor.actor import Actor
from embodirl.models.state_policy import StateMLPPolicy

from .helpers import actor_cfg, grpo
from .test_learning import H, N, collect, toy_env

DECAY = 0.5


def test_the_average_weights_each_update_by_powers_of_the_decay():
    env = toy_env(N)
    try:
        torch.manual_seed(0)
        policy = StateMLPPolicy(4, 2, H, hidden_sizes=(32, 32), critic_hidden_sizes=(32, 32), obs_norm=True)
        actor = Actor(policy, actor_cfg(grpo(), {"global_batch_size": N, "micro_batch_size": N, "optim.lr": 3e-2,
                                                 "ema_decay": DECAY}), task_table=env.spec.task_descriptions)
        weights = [{n: p.detach().clone() for n, p in actor._trainable}]
        for seed in range(1, 4):
            actor.step(collect(env, policy, seed=seed))
            weights.append({n: p.detach().clone() for n, p in actor._trainable})
    finally:
        env.close()
    stats = {n for n in weights[0] if n.startswith("obs_norm.")}
    w0, w1, w2, w3 = weights
    averaged = {n for n, _ in actor._averaged()}
    # GRPO: no gradient reaches the value head; none ever reaches the statistics
    assert averaged and all(n.startswith("actor.") or n == "log_std" for n in averaged), averaged
    d = DECAY
    for name in averaged:
        expected = d**3 * w0[name] + d**2 * (1 - d) * w1[name] + d * (1 - d) * w2[name] + (1 - d) * w3[name]
        torch.testing.assert_close(actor.ema[name], expected, rtol=1e-5, atol=1e-7)
    evaluated = actor.gather_trainable(evaluated=True)     # what a checkpoint's policy export holds
    for name in weights[0]:
        assert torch.equal(evaluated[name], actor.ema[name] if name in averaged else w3[name]), name
    assert stats and all(not torch.equal(w0[n], w3[n]) for n in stats)   # the statistics moved: taken as they are

    live = {n: p.detach().clone() for n, p in actor._trainable}
    average = {n: t.clone() for n, t in actor.ema.items()}
    assert actor.swap_ema() is True
    for n, p in actor._trainable:
        assert torch.equal(p.detach(), average[n] if n in averaged else live[n]), n
    assert actor.swap_ema() is False
    assert all(torch.equal(p.detach(), live[n]) and torch.equal(actor.ema[n], average[n]) for n, p in actor._trainable)
