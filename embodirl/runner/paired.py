"""Paired comparison of two policies on the same evaluation episodes: pure statistics (no torch, no Ray).

Episode ``j`` of an evaluation sweep is fixed by its (task, init state) and evaluation acts greedily, so two
checkpoints scored on the same sweep give one *pair* of outcomes per episode: both succeed, A only, B only, or
neither. Only the discordant pairs (A only: ``b``, B only: ``c``) tell the policies apart:

* **Exact McNemar test** (two-sided, conditional on ``b + c``): under H0 (for every episode, A-only and B-only are
  equally likely) each discordant pair is A-only with probability 1/2, so ``b ~ Bin(b + c, 1/2)`` and
  ``p = min(1, 2 P(X <= min(b, c)))`` (:func:`mcnemar_exact`; Fagerland, Lydersen & Laake, *Statistical Analysis
  of Contingency Tables*, 2017, ch. 8: Cavo et al.'s b = 6, c = 16 give p = 0.052479).
* **Paired difference** ``p_B - p_A = (c - b) / n`` with Newcombe's square-and-add interval for paired data
  (Newcombe 1998, *Stat Med* 17:2635, method 10): the two success rates' Wilson intervals combined with their
  estimated correlation (:func:`paired_difference_ci`); it stays within [-1, 1] and is not a point at 0 or n.
* **Multiple comparisons**: the per-task p-values are adjusted with Holm's step-down method (Holm 1979), which
  keeps the probability of calling any task different when none is at ``alpha`` (family-wise, any dependence
  between tasks) and rejects at least what Bonferroni does (:func:`holm`). Suite and overall tests are single
  hypotheses and are not adjusted; the overall test is the primary one.
* **Sequential stop** (:class:`GroupSequentialMcNemar`): the exact McNemar test at a few planned looks with a
  Lan-DeMets alpha-spending function (O'Brien-Fleming-type by default). Under H0 the directions of the discordant
  pairs are fair coins whatever the episodes, so given the discordant counts at the looks the chance of ever
  crossing the boundaries is computed exactly (a binomial random walk), and each look's boundary is the widest
  whose cumulative crossing probability stays within the alpha spent so far: the overall type-I error is at most
  ``alpha`` for every sequence of discordant counts, hence also unconditionally. O'Brien-Fleming-type spending
  keeps nearly all of ``alpha`` for the last look, so a comparison that runs to the end loses little power
  against the fixed-sample test, while a large difference stops at an early look.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

from embodirl.runner.eval_report import Z95, wilson_interval

SPENDING = ("obrien_fleming", "pocock")


def binomial_half_cdf(k: int, m: int) -> float:
    """``P(X <= k)`` for ``X ~ Bin(m, 1/2)``, exactly (integer sums, one rounding at the end)."""
    if k < 0:
        return 0.0
    if k >= m:
        return 1.0
    return sum(math.comb(m, i) for i in range(k + 1)) / 2**m


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact (conditional) McNemar p-value for ``b`` A-only and ``c`` B-only pairs:
    ``min(1, 2 P(X <= min(b, c)))``, ``X ~ Bin(b + c, 1/2)``; 1 when there is no discordant pair."""
    m = b + c
    if m == 0:
        return 1.0
    return min(1.0, 2.0 * binomial_half_cdf(min(b, c), m))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: sorted ascending, the i-th (from 0) is multiplied
    by ``m - i``, made non-decreasing (running maximum) and capped at 1. Rejecting where the adjusted p-value is
    ``<= alpha`` is Holm's procedure at family-wise level ``alpha``."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def paired_difference_ci(both: int, a_only: int, b_only: int, neither: int, z: float = Z95) -> tuple[float, float]:
    """Newcombe's square-and-add interval (1998, method 10) for ``p_B - p_A`` from a paired 2x2 table: with
    ``l, u`` the Wilson limits of each success rate and ``psi`` their estimated correlation (Newcombe's
    corrected phi: 0 when a margin is empty or ``0 <= ad - bc <= n/2``, ``(ad - bc - n/2) / sqrt(margins)`` above,
    ``(ad - bc) / sqrt(margins)`` below), the limits for ``delta = p_A - p_B`` are
    ``delta - sqrt((p_A - l_A)^2 + (u_B - p_B)^2 - 2 psi (p_A - l_A)(u_B - p_B))`` and
    ``delta + sqrt((p_B - l_B)^2 + (u_A - p_A)^2 - 2 psi (p_B - l_B)(u_A - p_A))``; returned negated and swapped.
    No pairs: (-1, 1)."""
    n = both + a_only + b_only + neither
    if n == 0:
        return -1.0, 1.0
    a_succ, b_succ = both + a_only, both + b_only
    p_a, p_b = a_succ / n, b_succ / n
    l_a, u_a = wilson_interval(a_succ, n, z)
    l_b, u_b = wilson_interval(b_succ, n, z)
    margins = a_succ * (n - a_succ) * b_succ * (n - b_succ)
    det = both * neither - a_only * b_only
    if margins == 0 or 0 <= det <= n / 2:
        psi = 0.0
    elif det > n / 2:
        psi = (det - n / 2) / math.sqrt(margins)
    else:
        psi = det / math.sqrt(margins)
    delta = p_a - p_b
    low = delta - math.sqrt(max(0.0, (p_a - l_a) ** 2 + (u_b - p_b) ** 2 - 2 * psi * (p_a - l_a) * (u_b - p_b)))
    high = delta + math.sqrt(max(0.0, (p_b - l_b) ** 2 + (u_a - p_a) ** 2 - 2 * psi * (p_b - l_b) * (u_a - p_a)))
    return max(-1.0, -high), min(1.0, -low)


def summarize(pairs: Iterable[tuple[bool, bool]]) -> dict:
    """Counts, success rates, the paired difference ``p_B - p_A`` with its 95 % interval and the exact McNemar
    p-value of ``(a_success, b_success)`` pairs."""
    counts = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
    for a, b in pairs:
        counts[bool(a), bool(b)] += 1
    both, a_only, b_only, neither = (counts[True, True], counts[True, False], counts[False, True],
                                     counts[False, False])
    n = both + a_only + b_only + neither
    low, high = paired_difference_ci(both, a_only, b_only, neither)
    return {"n_pairs": n, "a_successes": both + a_only, "b_successes": both + b_only,
            "a_success_rate": (both + a_only) / n if n else 0.0, "b_success_rate": (both + b_only) / n if n else 0.0,
            "both": both, "a_only": a_only, "b_only": b_only, "neither": neither,
            "difference": (b_only - a_only) / n if n else 0.0, "difference_ci95": [round(low, 6), round(high, 6)],
            "p_value": mcnemar_exact(a_only, b_only)}


def better(summary: dict, differs: bool) -> str | None:
    """``"a"`` or ``"b"`` when the test found a difference, the side with more successes; else None."""
    if not differs or summary["a_only"] == summary["b_only"]:
        return None
    return "b" if summary["b_only"] > summary["a_only"] else "a"


def compare_stats(episodes: Sequence[dict], alpha: float) -> dict:
    """Per task, per suite and overall paired statistics of ``episodes`` (dicts with ``suite``, ``task_id``,
    ``task``, ``a_success``, ``b_success``). Per task: :func:`summarize` plus ``p_holm`` (Holm over the tasks) and
    ``differs`` (``p_holm <= alpha``); per suite and overall: ``differs`` is ``p_value <= alpha``."""
    by_task: dict[tuple[str, int], list[dict]] = defaultdict(list)
    by_suite: dict[str, list[dict]] = defaultdict(list)
    for e in episodes:
        by_task[e["suite"], e["task_id"]].append(e)
        by_suite[e["suite"]].append(e)

    def pairs(eps: Sequence[dict]) -> list[tuple[bool, bool]]:
        return [(e["a_success"], e["b_success"]) for e in eps]

    per_task = [{"suite": suite, "task_id": task_id, "task": eps[0]["task"], **summarize(pairs(eps))}
                for (suite, task_id), eps in sorted(by_task.items())]
    for row, p_adj in zip(per_task, holm([row["p_value"] for row in per_task]), strict=True):
        row["p_holm"] = p_adj
        row["differs"] = p_adj <= alpha
        row["better"] = better(row, row["differs"])
    per_suite = {}
    for suite, eps in sorted(by_suite.items()):
        row = summarize(pairs(eps))
        row["differs"] = row["p_value"] <= alpha
        row["better"] = better(row, row["differs"])
        per_suite[suite] = {**row, "n_tasks": len({e["task_id"] for e in eps})}
    overall = summarize(pairs(episodes))
    overall["differs"] = overall["p_value"] <= alpha
    overall["better"] = better(overall, overall["differs"])
    return {"per_task": per_task, "per_suite": per_suite, "overall": overall}


def plan_looks(schedule: Sequence[tuple[int, int, int]], looks: int) -> list[list[int]]:
    """The ``episode_ix`` of each part of a sweep ``schedule`` (``(episode_ix, task_id, init_state_id)`` in sweep
    order) run between two looks. One look: the sweep in its order. Several: the episodes taken round-robin over
    the tasks (every task's first trial, then every task's second, ...), cut into ``looks`` parts of nearly equal
    size, so that each part holds every task about equally and an early stop speaks for the whole suite, not for
    the tasks that come first in the sweep. Empty parts (more looks than episodes) are left out."""
    if looks <= 1:
        return [[j for j, _, _ in schedule]]
    by_task: dict[int, list[int]] = {}
    for j, task_id, _ in schedule:
        by_task.setdefault(task_id, []).append(j)
    rounds = max((len(v) for v in by_task.values()), default=0)
    order = [v[r] for r in range(rounds) for v in by_task.values() if r < len(v)]
    bounds = [round(i * len(order) / looks) for i in range(looks + 1)]
    return [order[lo:hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


# --- the sequential stop -----------------------------------------------------------------------------------------
def spent_alpha(kind: str, alpha: float, t: float) -> float:
    """The type-I error a Lan-DeMets spending function allows by information fraction ``t`` in (0, 1]
    (Lan & DeMets 1983): ``obrien_fleming`` ``2 - 2 Phi(z_{1-alpha/2} / sqrt(t))``, ``pocock``
    ``alpha ln(1 + (e - 1) t)``; both give ``alpha`` at ``t = 1``."""
    if kind not in SPENDING:
        raise ValueError(f"spending '{kind}' is not one of {', '.join(SPENDING)}")
    t = min(1.0, max(0.0, t))
    if t >= 1.0:
        return alpha
    if t <= 0.0:
        return 0.0
    if kind == "pocock":
        return alpha * math.log(1.0 + (math.e - 1.0) * t)
    normal = NormalDist()
    return 2.0 - 2.0 * normal.cdf(normal.inv_cdf(1.0 - alpha / 2.0) / math.sqrt(t))


def _half_binomial_pmf(m: int) -> np.ndarray:
    """``P(X = i)``, ``i = 0..m``, ``X ~ Bin(m, 1/2)`` (log-space: no overflow for large ``m``)."""
    i = np.arange(m + 1)
    log_pmf = (math.lgamma(m + 1) - np.array([math.lgamma(k + 1) + math.lgamma(m - k + 1) for k in i])
               - m * math.log(2.0))
    return np.exp(log_pmf)


@dataclass
class Look:
    """One interim (or the final) analysis of :class:`GroupSequentialMcNemar`."""

    look: int                      # 1-based
    n_pairs: int                   # pairs so far
    a_only: int
    b_only: int
    information: float             # n_pairs / planned pairs
    alpha_spent: float             # what the spending function allows by this look
    crossing_probability: float    # exact H0 probability of having stopped by this look, given the discordant counts
    boundary: int                  # stop when min(a_only, b_only) <= boundary (-1: no count can)
    stop: bool

    def to_dict(self) -> dict:
        return asdict(self)


class GroupSequentialMcNemar:
    """The exact McNemar test repeated at planned looks with alpha spending (see module docstring).

    Call :meth:`look` with the cumulative counts after each batch of pairs; it returns :class:`Look` with ``stop``
    true once ``min(a_only, b_only)`` is at or below the look's boundary. The boundary at a look with ``m``
    discordant pairs is the largest ``r < m / 2`` such that the exact H0 probability of a crossing at this or an
    earlier look (directions of discordant pairs i.i.d. fair coins, ``m`` known at every look so far) is at most
    the spending function's ``alpha(n_pairs / planned_pairs)``. With a single look at ``planned_pairs`` it is the
    exact McNemar test at level ``alpha``.

    State: the H0 distribution of the A-only count over the paths that have not crossed yet (``_alive[i]``:
    probability that ``a_only = i`` at the last look and no boundary was crossed before).
    """

    def __init__(self, planned_pairs: int, alpha: float, spending: str = "obrien_fleming"):
        if planned_pairs < 1:
            raise ValueError("planned_pairs must be positive")
        if not 0.0 < alpha < 1.0:
            raise ValueError("alpha must be in (0, 1)")
        spent_alpha(spending, alpha, 1.0)                  # the kind is known
        self.planned_pairs = planned_pairs
        self.alpha = alpha
        self.spending = spending
        self.looks: list[Look] = []
        self._alive = np.ones(1)                           # no discordant pair yet: a_only = 0 with probability 1
        self._crossed = 0.0

    @property
    def stopped(self) -> bool:
        return bool(self.looks) and self.looks[-1].stop

    def look(self, n_pairs: int, a_only: int, b_only: int) -> Look:
        """The analysis after ``n_pairs`` pairs in all, ``a_only`` and ``b_only`` of them discordant."""
        if self.stopped:
            raise ValueError("the comparison already stopped")
        prev = self.looks[-1] if self.looks else None
        m_prev = len(self._alive) - 1
        m = a_only + b_only
        if prev is not None and (n_pairs <= prev.n_pairs or a_only < prev.a_only or b_only < prev.b_only):
            raise ValueError("looks take cumulative counts: more pairs, and discordant counts that never decrease")
        if n_pairs > self.planned_pairs or m > n_pairs:
            raise ValueError(f"{n_pairs} pairs ({m} discordant) at a look of {self.planned_pairs} planned pairs")
        alive = np.convolve(self._alive, _half_binomial_pmf(m - m_prev))      # (m + 1,): a_only = 0..m
        information = n_pairs / self.planned_pairs
        allowed = spent_alpha(self.spending, self.alpha, information)
        # tails[r] = H0 mass of min(a_only, m - a_only) <= r among the paths still alive (r < m / 2: disjoint tails)
        boundary, crossing = -1, 0.0
        lower, upper = 0.0, 0.0
        for r in range((m + 1) // 2):                     # r < m / 2
            lower += alive[r]
            upper += alive[m - r]
            if self._crossed + lower + upper > allowed * (1.0 + 1e-12):
                break
            boundary, crossing = r, float(lower + upper)
        if boundary >= 0:
            alive[:boundary + 1] = 0.0
            alive[m - boundary:] = 0.0
        self._crossed += crossing
        self._alive = alive
        result = Look(look=len(self.looks) + 1, n_pairs=n_pairs, a_only=a_only, b_only=b_only,
                      information=information, alpha_spent=allowed, crossing_probability=self._crossed,
                      boundary=boundary, stop=min(a_only, b_only) <= boundary)
        self.looks.append(result)
        return result
