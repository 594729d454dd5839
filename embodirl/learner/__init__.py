"""The learner: FSDP2 wrapping (:mod:`.fsdp`), optimizer (:mod:`.optim`), replay buffer
(:mod:`.replay_buffer`) and the update loop with weight publishing (:mod:`.learner`)."""

from embodirl.learner.learner import Learner, prepare_batch
from embodirl.learner.replay_buffer import ReplayBuffer

__all__ = ["Learner", "ReplayBuffer", "prepare_batch"]
