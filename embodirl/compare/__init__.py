"""``embodirl compare A B [overrides]``: two checkpoints scored on the same evaluation episodes, compared pair by pair.

:mod:`.compose` composes and checks the command (``config/compare.yaml``) and resolves each side's checkpoint before
any worker starts; :mod:`.sweep` runs the evaluation sweep for both sides through the evaluation code of ``embodirl
eval`` (:meth:`~embodirl.runner.loop.Runner.eval_workers`, :func:`~embodirl.runner.evaluation.sweep_episodes`),
optionally in parts with a sequential stop, and writes ``compare_info.json``; the statistics are
:mod:`embodirl.runner.paired`'s.
"""
