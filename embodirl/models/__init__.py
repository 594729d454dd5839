"""Policies (OpenVLA-OFT, state MLP), the action tokenizer and the image processor; selected by name
through :mod:`embodirl.models.registry`."""
