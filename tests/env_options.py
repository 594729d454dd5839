"""An env option of ``config/env/`` as the env tests take it: composed with the bases it lists in its defaults
(``config/env/_base.yaml``, ...) into the plain dict of ``env.train``, a fresh copy each call."""

from __future__ import annotations

import copy
import functools

from omegaconf import OmegaConf


@functools.cache
def _composed(option: str) -> dict:
    from embodirl.config import compose

    return OmegaConf.to_container(compose([f"env={option}"]).env.train, resolve=True)


def env_option(option: str) -> dict:
    """``env.train`` of ``env=<option>`` as a plain dict."""
    return copy.deepcopy(_composed(option))
