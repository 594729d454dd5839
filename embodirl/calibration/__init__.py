"""Calibration of a run's parts on this machine, and the step time they predict (``embodirl doctor --bench``).

:mod:`~embodirl.calibration.measure` times the real components of one config (simulator physics per low-level step,
rendering per camera frame at a decision point, the policy's ``act`` at the batch an inference worker sees, one real
update of the actor, one publication of the trainable weights); :mod:`~embodirl.calibration.predict` turns those
rates and the config's recipe and placement into seconds per training step, its bottleneck and the wall-clock of
``runner.max_steps``; :mod:`~embodirl.calibration.report` prints the table and keeps ``prediction.json`` in a run
folder, with the run's measured phase times beside the prediction.

The package sits above envs, models, rollout and actor and below the runner (which calls :mod:`.report` when
``runner.predict_step_time`` is set, and at the end of every run).
"""
