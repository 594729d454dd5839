"""Train the state MLP on ManiSkill PushCube with PPO, wiring embodirl's parts by hand: the page to read first.

    python examples/train_pushcube_state.py                        # the default job's settings, 100 steps
    python examples/train_pushcube_state.py --steps 2 --num-envs 4 --max-episode-steps 10

One training step is collect -> advantages -> update, all in this process:

* env:       16 PushCube simulators, one sub-process each, stepped one action chunk ``[B, H, A]`` at a time
* policy:    a Gaussian MLP actor-critic over the state vector, producing chunks of H = 2 actions
* collector: env + policy -> one trajectory batch ``[N, T]`` (N rows of T decisions; embodirl/data.py)
* actor:   GAE advantages and PPO epochs on that batch; it trains the very module the collector acts with

`embodirl train` runs the same pieces, plus evaluation, checkpoints, logging and Ray when asked for.
"""

import argparse
import time

import numpy as np
import torch

from embodirl import data as D
from embodirl.actor.actor import Actor
from embodirl.config import compose
from embodirl.envs.registry import make_env
from embodirl.models.base import SamplingParams
from embodirl.models.registry import make_policy
from embodirl.rollout.collector import RolloutCollector
from embodirl.rollout.inference import PolicyInference
from embodirl.rollout.records import decisions_per_episode
from embodirl.schema import run_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="training steps (collect -> update)")
    parser.add_argument("--num-envs", type=int, default=16, help="simulators (one process each)")
    parser.add_argument("--max-episode-steps", type=int, default=50, help="simulator steps per episode")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    # 1. Configuration: config/config.yaml with the default job's options (env=maniskill_pushcube, model=state_mlp,
    #    algorithm=ppo and config/recipe/maniskill_pushcube_state_mlp.yaml) and this script's flags on top, as the
    #    typed object the code runs on (each section its schema dataclass, embodirl/schema/).
    cfg = run_config(compose([f"env.train.num_envs={args.num_envs}", f"env.train.max_episode_steps={args.max_episode_steps}",
                              f"runner.seed={args.seed}"]))
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)

    # 2. Env: a ProcessVectorEnv of num_envs simulators (envs/maniskill/simulator.py, envs/vector/vector_env.py).
    env = make_env(cfg.env.train, num_envs=args.num_envs, seed=args.seed)
    H = cfg.model.action_chunk
    print(f"{env.spec.name}: {env.num_envs} envs, state {env.spec.state_dim}-D, action {env.spec.action_dim}-D, chunks of {H}")

    # 3. Policy: looked up by model.name in the model registry (embodirl/models/state_policy.py).
    policy = make_policy(cfg.model, env.spec)

    # 4. Collector: asks the policy for a chunk per decision (sampling at rollout.temperature), steps the envs,
    #    and records T decisions per slot with log-probs and values (PPO's critic) into one batch [N, T].
    sampling = SamplingParams(temperature=float(cfg.rollout.temperature))
    inference = PolicyInference(policy, env.spec.task_descriptions, sampling)
    collector = RolloutCollector([env], inference, num_decisions=decisions_per_episode(cfg),
                                 auto_reset=cfg.env.train.auto_reset, return_value=True, seed=args.seed)

    # 5. Actor: the optimizer over the policy's weights; step() computes advantages (algorithm.adv_type = gae)
    #    and runs algorithm.update_epochs PPO epochs (embodirl/algorithms/losses.py).
    actor = Actor(policy, cfg, task_table=env.spec.task_descriptions, temperature=sampling.temperature)

    try:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            # rollout.rollout_epoch rollouts per step, each from new episode starts (seeded per step and rollout)
            policy.eval()
            rollouts = [collector.collect(seed=args.seed + 1_000_003 * step + 7_919 * k)
                        for k in range(cfg.rollout.rollout_epoch)]
            batch = D.concat(rollouts) if len(rollouts) > 1 else rollouts[0]
            metrics = actor.step(batch)       # the inference above acts with this same module: no weight copy

            # every row is one episode here (no auto-reset): it ends at its last valid decision
            valid = batch.get(D.VALID)                                               # (N, T)
            reward = batch.get(D.REWARD)                                             # (N, T): chunk-level rewards
            ended = (batch.get(D.TERMINATED) | batch.get(D.TRUNCATED)) & valid       # (N, T)
            episodes = max(int(ended.sum()), 1)
            episode_return = float((reward * valid).sum()) / episodes
            success = float((batch.get(D.SUCCESS) & ended).sum()) / episodes
            print(f"step {step:4d}  return {episode_return:8.3f}  success {success:.2f}  "
                  f"pg_loss {float(metrics['actor/pg_loss']):+.4f}  value_loss {float(metrics['critic/value_loss']):.4f}  "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
    finally:
        env.close()


if __name__ == "__main__":   # simulators start in sub-processes that import this file: keep it import-safe
    main()
