"""The rollout pieces as workers: env workers, inference workers, the actor's ranks, their groups.

``env_worker``, ``inference_worker`` and ``actor_worker`` are plain classes; ``worker_set`` runs them as objects
in this process or on Ray (the one place that tells the two apart); ``groups`` creates the env and inference
workers (with their placement on Ray), runs collection and weight sync, ``layout`` splits the slots and
``recovery`` replaces dead workers; ``actor_group`` holds the actor's ranks; ``stream`` (shared memory on one
node) and ``transport`` (in-process, or Ray's object store between nodes) move observation batches and
answers; ``engines`` holds the inference engines; ``weight_sync`` the versioned weight updates;
``placement_groups`` the Ray bundles; ``ray_cluster`` starts or joins Ray. No math here.
"""
