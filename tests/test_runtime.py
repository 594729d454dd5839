"""Process-level settings: torch's intra-op threads in the driver."""

from __future__ import annotations

import os

import torch

from embodirl import runtime


def test_auto_threads_follow_the_machine():
    cores = os.cpu_count() or 1
    expected = 1 if cores <= 4 else min(8, cores // 2)
    assert runtime.torch_threads("auto", cuda=False) == expected
    assert runtime.torch_threads(None, cuda=False) == expected
    assert runtime.torch_threads("auto", cuda=True) is None       # GPU machines keep torch's default
    assert runtime.torch_threads(3, cuda=False) == 3


def test_set_torch_threads_applies_the_setting():
    before = torch.get_num_threads()
    try:
        runtime.set_torch_threads(1)
        assert torch.get_num_threads() == 1
        runtime.set_torch_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
