"""Thin Ray shells around the rollout pieces: env workers, rollout workers, their groups.

``env_worker`` and ``rollout_worker`` are plain classes (usable in-process, zero remote workers);
``groups`` creates them as Ray actors with their placement, runs collection and weight sync and
recovers from dead workers; ``stream`` (shared memory on one node) and ``transport`` (in-process, or
Ray's object store between nodes) move observation batches and answers; ``backends`` holds the
inference engines; ``weight_sync`` the versioned weight updates; ``placement_groups`` the Ray
bundles; ``ray_cluster`` starts or joins Ray. No math here.
"""
