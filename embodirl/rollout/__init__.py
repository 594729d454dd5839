"""Env + policy -> ``Trajectory`` in one process, no Ray needed.

``collector`` runs S pipelined env batches for T decisions against an inference client;
``records`` assembles per-decision records into the trajectory contract; ``inference`` is the
request/result protocol (and its in-process form over a policy); ``starts`` plans episode starts and
GRPO groups. The worker layer (:mod:`embodirl.workers`) runs exactly this loop inside env workers.
"""
