"""``embodirl sft``: supervised fine-tuning of OpenVLA-OFT's action tokens on a LeRobot dataset.

:mod:`.config` composes and checks the run (``config/sft.yaml``), :mod:`.data` turns dataset samples into
actor batches and computes the ``dataset_statistics.json`` entry, :mod:`.loop` runs the steps through the
RL path's actor group and actor (``ActorGroup.sft_train`` -> ``Actor.sft_update``).
"""
