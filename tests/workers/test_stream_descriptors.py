"""The shared-memory stream serves in a process with more than 1,024 file descriptors open (a Ray worker with many
connections): ``select.select`` raises for a descriptor numbered above ``FD_SETSIZE``, so the server's loop, which
swallowed the error, spun without answering and a reader waiting on its ring raised. The real server and rings, in
this process."""

from __future__ import annotations

import os
import resource
import time

import numpy as np
import pytest

from embodirl.channel.shm_channel import ShmChannel, ShmReader
from embodirl.rollout.inference import PolicyOutput
from embodirl.workers.stream import StreamServer

FD_SETSIZE = 1024
OPEN = 1100


def _decide(obs, want_value: bool, mode: str) -> PolicyOutput:
    return PolicyOutput({"action": np.asarray(obs["state"]) * 2.0}, 7, {})


def test_the_stream_serves_with_more_than_1024_descriptors_open():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < OPEN + 100:
        pytest.skip(f"this process may open at most {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, OPEN + 100), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(OPEN)]
    server = StreamServer(_decide, has_value=False)
    reader = ShmReader()
    obs = {"state": np.arange(6, dtype=np.float32).reshape(2, 3)}                    # (B, S)
    request = ShmChannel(obs, num_slots=4, tag="fds")
    try:
        info, first, _ = server.open(request.info, request.put(obs), 0)
        np.testing.assert_array_equal(first.fields["action"], obs["state"] * 2)
        for i in range(3):
            batch = {"state": obs["state"] + i}
            request.send(batch, meta=0)
            msg = reader.recv(info, timeout=10.0)
            assert msg is not None, f"batch {i} was not answered"
            ref, _ = msg
            views = reader.read(ref)
            np.testing.assert_array_equal(views["action"], batch["state"] * 2)
            del views
            reader.release(ref)
        deadline = time.monotonic() + 10.0      # the server counts a batch after its answer is sent
        while server.served < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert reader.ready_fd(info) > FD_SETSIZE and server.served == 3
    finally:
        server.close()
        reader.close()
        request.close()
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
