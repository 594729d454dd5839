"""Moving observation batches between processes on one node without copying them through pickles.

``segments`` names and cleans up shared memory for a run; ``shm_channel`` is the bounded ring of
preallocated slots (producer :class:`ShmChannel`, consumer :class:`ShmReader`), usable as a queue
(send/recv) or by passing references. Nothing here imports Ray: the worker layer decides when to use
the ring and when to fall back to Ray's object store.
"""
