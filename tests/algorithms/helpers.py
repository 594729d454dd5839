"""The typed ``algorithm`` section for tests that call the algorithms directly: the default config's, with the
fields a test sets replaced (the algorithms read nothing else)."""

from __future__ import annotations

import dataclasses
import functools

from embodirl.algorithms.section import AlgorithmSection, algorithm_of


@functools.cache
def default_algorithm() -> AlgorithmSection:
    from embodirl.config import compose

    return algorithm_of(compose([]).algorithm)


def algorithm(**fields) -> AlgorithmSection:
    """The default ``algorithm`` section with ``fields`` replaced (``filter_groups``/``kl_ctrl`` take dicts of the
    nested fields to replace)."""
    base = default_algorithm()
    for nested in ("filter_groups", "kl_ctrl"):
        if isinstance(fields.get(nested), dict):
            fields[nested] = dataclasses.replace(getattr(base, nested), **fields[nested])
    return dataclasses.replace(base, **fields)
