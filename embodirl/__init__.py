"""embodirl: reinforcement-learning fine-tuning of vision-language-action robot policies.

The package is laid out along the dataflow of one training step (see docs in the README):
``envs`` (simulators, chunk execution, video) -> ``rollout`` (env + policy -> Trajectory)
-> ``algorithms`` (advantages, losses) -> ``actor`` (FSDP updates) -> ``runner`` (the loop).
``workers`` wraps those pieces as workers (in this process or on Ray); ``data`` holds the batch contract.
"""

__version__ = "0.1.0"
