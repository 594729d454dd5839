"""The actor: FSDP2 wrapping (:mod:`.fsdp`), optimizer (:mod:`.optim`), replay buffer
(:mod:`.replay_buffer`) and the update loop with weight publishing (:mod:`.actor`)."""
