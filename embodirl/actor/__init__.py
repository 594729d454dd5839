"""The actor: the trainable policy, its optimizer and its updates. Files, along the dataflow:

* ``settings.py``      - the typed ``algorithm`` and ``actor`` sections the actor reads;
* ``batch.py``         - the driver-side preparation of a whole rollout batch (``prepare_batch``) and the check of a shard;
* ``sharding.py``      - a prepared batch cut into the ranks' shards of whole groups;
* ``replay_buffer.py`` - which rollouts an update trains on (on-policy, or the last K with importance weights);
* ``actor.py``         - :class:`~embodirl.actor.actor.Actor`: the RL update (epochs, optimizer steps, micro-batches),
  reference log-probs, weight publishing;
* ``optim.py``         - AdamW, the learning-rate schedule, gradient clipping, the non-finite guard of a step;
* ``metrics.py``       - the update's whole-batch metrics, reduced over the ranks;
* ``ema.py``           - the moving average of the weights that evaluation acts with (``actor.ema_decay``);
* ``sft.py``           - the supervised step (``embodirl sft``) through the same optimizer;
* ``fsdp.py``          - FSDP2 wrapping and the few torch.distributed helpers;
* ``sharded_state.py`` - the actor's resumable state on disk, written and read by every rank.
"""
