"""ManiSkill 3 as an embodirl simulator: ``simulator`` (one scene per process, the settings, observation conversion),
``gpu`` (GPU-batched scenes in one process), ``adapter`` (the ``maniskill`` adapter that picks between them),
``tasks`` (the task table, instructions, assets) and ``preload`` (what the simulator processes' fork server imports)."""
