"""The layout of one run checkpoint folder, ``<output_dir>/checkpoints/step_<n>/``: the names every writer and reader
of its parts shares (the runner writes and resumes a run, actor ranks write and read their state, evaluation reads
the policy). Saving and finding checkpoints: :mod:`embodirl.runner.checkpoint`.

A checkpoint (the part folders are what :class:`~embodirl.runner.loop.Runner` writes)::

    step_<n>/
      COMPLETE                     {"step": n, "parts": [...]}; written last
      policy/                      the trained policy, loadable on its own (Policy.load_trainable)
        adapter_config.json        LoRA models: the adapter in peft's layout, written by
        adapter_model.safetensors    PeftModel.save_pretrained (with the modules-to-save copies)
        trainable.safetensors      the other trained tensors by parameter name: the value head; for
                                     full-weight models (state_mlp, full fine-tuning) every trained tensor
      actor/tensors/*.safetensors  trainable parameters and AdamW moments, one file per actor rank
                                     (torch.distributed.checkpoint; loads into any number of ranks)
      actor/state.json           LR schedule, KL controller, optimizer settings, counters, world size
                                     (+ replay_rank<r>.* when the replay buffer holds rollouts); checkpoints
                                     written before the sharded state have learner/train_state.pt instead
      runner/state.json            the step, the start-planning generator's state, the collapse guard's state
      runner/rng.json              python / numpy / torch (and CUDA) RNG states of the driver (JSON, no pickle)
      runner/worker_rng.json       the same for each remote inference worker (Ray path), which samples actions
      config/config.yaml           the resolved config of the run
"""

from __future__ import annotations

from pathlib import Path

import torch

COMPLETE = "COMPLETE"
CHECKPOINTS = "checkpoints"
#: the parts the runner writes (sub-folders of a checkpoint)
POLICY, ACTOR, RUNNER, CONFIG = "policy", "actor", "runner", "config"
#: the actor ranks' part in checkpoints written before the learner ranks were called actor ranks
LEGACY_ACTOR = "learner"
TRAIN_STATE = "train_state.pt"
#: RNG states: JSON, never a pickle (a shared checkpoint must not run code where it is resumed)
RNG, WORKER_RNG = "rng.json", "worker_rng.json"
#: the pickled RNG files of checkpoints written before the JSON ones (:func:`embodirl.runner.checkpoint.load_rng` reads them)
LEGACY_RNG, LEGACY_WORKER_RNG = "rng.pt", "worker_rng.pt"
#: ``runner.resume_dir`` / ``runner.resume_mode`` value that turns resuming off
DISABLE = "disable"
#: a model checkpoint (public OpenVLA-OFT layout) has this file: it is given as model.path, not resumed from
MODEL_CONFIG = "config.json"


def load_train_state(folder: Path) -> dict:
    """The actor's state without its trained tensors, as checkpoints written before the actor state was sharded
    hold it (``TRAIN_STATE``)."""
    return torch.load(folder / TRAIN_STATE, weights_only=True)


def actor_state_dir(checkpoint: Path) -> Path:
    """Checkpoint ``step_<n>``'s actor state folder (``actor/``, or ``learner/`` in checkpoints written before)."""
    checkpoint = Path(checkpoint)
    legacy = checkpoint / LEGACY_ACTOR
    return legacy if not (checkpoint / ACTOR).exists() and legacy.exists() else checkpoint / ACTOR
