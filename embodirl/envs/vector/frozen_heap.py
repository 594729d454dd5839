"""The last module a simulator forkserver imports (``ProcessVectorEnv``'s ``preload``): it moves every object the
preloaded modules created into the garbage collector's permanent generation (:func:`gc.freeze`), so the simulator
processes forked from that server never walk them.

Without it, each full collection in a forked simulator visits the ~340k objects of the preloaded ManiSkill, SAPIEN
and torch, and writing their collector fields copies every page they sit on. Measured side by side on this
project's 2-core machine (``scripts/bench/bench_sim_start.py --compare frozen-heap --env maniskill_pushcube --num-envs 8
env.train.num_envs=8``, 3 rounds): 8 PushCube simulators built and reset held 827 MiB of private memory against
1436 unfrozen, and took 10.0 CPU-s to start against 11.2; one full collection in a forked process cost 0.18 CPU-s
against none. Objects frozen here are never collected; they are the modules' own, which live as long as the
process anyway."""

import gc

gc.collect()
gc.freeze()
