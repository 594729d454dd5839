"""The paired statistics of ``embodirl compare`` (:mod:`embodirl.runner.paired`) against hand-computed and published
values, and the sequential stop's type-I error and savings by simulation (numpy, fixed seeds)."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys

import numpy as np
import pytest

from embodirl.runner.paired import (
    GroupSequentialMcNemar,
    compare_stats,
    holm,
    mcnemar_exact,
    paired_difference_ci,
    plan_looks,
    spent_alpha,
    summarize,
)


def test_exact_mcnemar_by_hand_and_published():
    # b=10, c=2: 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 2 * 79 / 4096
    assert mcnemar_exact(10, 2) == pytest.approx(158 / 4096) == pytest.approx(0.0386, abs=5e-5)
    assert mcnemar_exact(2, 10) == mcnemar_exact(10, 2)               # two-sided: symmetric
    # Cavo et al. (2012) as in Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables, ch. 8:
    # "The McNemar exact conditional test: P = 0.052479"
    assert mcnemar_exact(6, 16) == pytest.approx(0.052479, abs=5e-7)
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(3, 3) == 1.0 and mcnemar_exact(4, 5) == 1.0
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    # one-sided would be half of it: the test must not be
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 64)


def test_holm_on_known_vectors():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # sorted 0.01 * 3 = 0.03, then 0.011 * 2 = 0.022 is raised to 0.03 (adjusted p-values never decrease)
    assert holm([0.011, 0.01, 0.5]) == pytest.approx([0.03, 0.03, 0.5])
    assert holm([0.6, 0.9]) == pytest.approx([1.0, 1.0])              # capped at 1
    assert holm([0.01]) == [0.01] and holm([]) == []


def test_newcombe_paired_interval_matches_the_published_one():
    # Cavo et al. (2012): both 59, A only 6, B only 16, neither 80; Fagerland et al. ch. 8 give for p_A - p_B
    # "estimate = -0.0621 (95% CI -0.1186 to -0.0046)"; this function reports p_B - p_A
    low, high = paired_difference_ci(59, 6, 16, 80)
    assert (round(low, 4), round(high, 4)) == (0.0046, 0.1186)
    # mirrored table, mirrored interval
    low2, high2 = paired_difference_ci(59, 16, 6, 80)
    assert (low2, high2) == pytest.approx((-high, -low))
    # all pairs agree and succeed: the interval still has width (not a point at 0), inside [-1, 1]
    low, high = paired_difference_ci(10, 0, 0, 0)
    assert -1 <= low < 0 < high <= 1
    assert paired_difference_ci(0, 0, 0, 0) == (-1.0, 1.0)


def test_summarize_counts_and_direction():
    pairs = [(True, True)] * 3 + [(True, False)] * 2 + [(False, True)] * 10 + [(False, False)] * 5
    s = summarize(pairs)
    assert (s["n_pairs"], s["both"], s["a_only"], s["b_only"], s["neither"]) == (20, 3, 2, 10, 5)
    assert (s["a_successes"], s["b_successes"]) == (5, 13)
    assert s["difference"] == pytest.approx((10 - 2) / 20) and s["difference_ci95"][0] > 0
    assert s["p_value"] == pytest.approx(mcnemar_exact(2, 10))


def test_compare_stats_per_task_holm_and_overall():
    def episodes(task, both, a_only, b_only, neither):
        cells = [(True, True)] * both + [(True, False)] * a_only + [(False, True)] * b_only + [(False, False)] * neither
        return [{"suite": "s", "task_id": task, "task": f"t{task}", "a_success": a, "b_success": b} for a, b in cells]

    eps = episodes(0, 0, 0, 10, 0) + episodes(1, 5, 2, 2, 1) + episodes(2, 0, 10, 2, 0)
    stats = compare_stats(eps, alpha=0.05)
    rows = {r["task_id"]: r for r in stats["per_task"]}
    raw = [mcnemar_exact(0, 10), mcnemar_exact(2, 2), mcnemar_exact(10, 2)]
    assert [rows[t]["p_value"] for t in range(3)] == pytest.approx(raw)
    assert [rows[t]["p_holm"] for t in range(3)] == pytest.approx(holm(raw))
    # task 0: 2/1024 * 3 < 0.05 -> B better; task 2: 0.0386 * 2 > 0.05 -> not after the adjustment (it is before)
    assert rows[0]["differs"] and rows[0]["better"] == "b"
    assert raw[2] <= 0.05 and not rows[2]["differs"] and rows[2]["better"] is None
    assert not rows[1]["differs"]
    o = stats["overall"]
    assert (o["a_only"], o["b_only"], o["n_pairs"]) == (12, 14, 32) and not o["differs"]
    assert stats["per_suite"]["s"]["n_tasks"] == 3


def test_plan_looks_interleaves_tasks_and_covers_the_sweep():
    schedule = [(j, j // 5, j % 5) for j in range(20)]           # 4 tasks x 5 trials, task-major as the sweep
    assert plan_looks(schedule, 1) == [list(range(20))]
    parts = plan_looks(schedule, 5)
    assert [len(p) for p in parts] == [4] * 5
    assert sorted(itertools.chain(*parts)) == list(range(20))
    assert all(sorted(j // 5 for j in p) == [0, 1, 2, 3] for p in parts)   # every task in every look
    assert [len(p) for p in plan_looks(schedule, 3)] == [7, 6, 7]
    assert len(plan_looks(schedule[:2], 5)) == 2                              # no empty looks


def test_spending_functions():
    for kind in ("obrien_fleming", "pocock"):
        values = [spent_alpha(kind, 0.05, t / 5) for t in range(1, 6)]
        assert values == sorted(values) and values[-1] == 0.05
    # O'Brien-Fleming-type: 2 - 2 Phi(1.959964 / sqrt(t)); at t = 1/4 the boundary is z = 3.92 (8.86e-5)
    assert spent_alpha("obrien_fleming", 0.05, 0.25) == pytest.approx(8.8575e-5, rel=1e-3)
    assert spent_alpha("pocock", 0.05, 0.5) == pytest.approx(0.05 * math.log(1 + (math.e - 1) / 2))
    with pytest.raises(ValueError):
        spent_alpha("linear", 0.05, 0.5)


def test_one_look_is_the_exact_mcnemar_test():
    for b, c in itertools.product(range(0, 14), range(0, 14)):
        look = GroupSequentialMcNemar(40, 0.05).look(40, b, c)
        assert look.stop == (mcnemar_exact(b, c) <= 0.05), (b, c)


@pytest.mark.parametrize("spending,alpha", [("obrien_fleming", 0.2), ("pocock", 0.2), ("pocock", 0.05)])
def test_sequential_type_one_error_exact_by_enumeration(spending, alpha):
    """Every direction sequence of the discordant pairs, each with probability 2^-m under H0: the probability that
    the boundaries (which depend on the discordant counts only) are crossed at some look is the crossing probability
    the test reports, and at most alpha."""
    discordant, pairs = (5, 9, 16), (20, 40, 60)
    test = GroupSequentialMcNemar(60, alpha, spending)
    boundaries = []
    for n, m in zip(pairs, discordant):            # balanced counts: the test does not stop, every boundary is set
        look = test.look(n, m // 2, m - m // 2)
        assert not look.stop
        boundaries.append(look.boundary)
    assert max(boundaries) >= 0                    # a boundary that can be crossed: the check is not vacuous
    paths = np.array(list(itertools.product((0, 1), repeat=discordant[-1])))     # 1: an A-only pair
    crossed = np.zeros(len(paths), bool)
    for m, r in zip(discordant, boundaries):
        a_only = paths[:, :m].sum(1)
        crossed |= np.minimum(a_only, m - a_only) <= r
    rejection = crossed.mean()
    assert rejection == pytest.approx(test.looks[-1].crossing_probability, abs=1e-12)
    assert rejection <= alpha


def _simulate(cells, planned, looks, sims, seed, *, spending="obrien_fleming", alpha=0.05, naive=False):
    """Rejection rate and mean pairs used of the sequential test on ``sims`` simulated comparisons: each pair is
    both / A only / B only / neither with probabilities ``cells``, looks after every ``planned / looks`` pairs.
    ``naive``: the exact McNemar test at ``alpha`` at every look instead (no spending)."""
    rng = np.random.default_rng(seed)
    outcomes = rng.choice(4, size=(sims, planned), p=cells)
    a_only, b_only = np.cumsum(outcomes == 1, axis=1), np.cumsum(outcomes == 2, axis=1)
    ends = [round(k * planned / looks) for k in range(1, looks + 1)]
    rejected, used, fixed = 0, 0, 0
    for i in range(sims):
        test = GroupSequentialMcNemar(planned, alpha, spending)
        for n in ends:
            b, c = int(a_only[i, n - 1]), int(b_only[i, n - 1])
            stop = mcnemar_exact(b, c) <= alpha if naive else test.look(n, b, c).stop
            if stop:
                break
        rejected += stop
        used += n
        fixed += mcnemar_exact(int(a_only[i, -1]), int(b_only[i, -1])) <= alpha
    return rejected / sims, used / sims, fixed / sims


# H0: A-only and B-only equally likely (0.15 each), the rest concordant; 500 pairs, 5 looks, as LIBERO-10's protocol
H0 = (0.5, 0.15, 0.15, 0.2)


@pytest.mark.parametrize("spending", ["obrien_fleming", "pocock"])
def test_sequential_stop_keeps_its_type_one_error_by_simulation(spending):
    sims, alpha = 20000, 0.05
    slack = 3 * math.sqrt(alpha * (1 - alpha) / sims)           # three Monte-Carlo standard errors (0.0046)
    rate, used, fixed = _simulate(H0, 500, 5, sims, seed=20261205, spending=spending, alpha=alpha)
    print(f"H0, {spending}: sequential rejection {rate:.4f}, fixed-sample {fixed:.4f}, mean pairs {used:.1f}")
    assert rate <= alpha + slack
    assert fixed <= alpha + slack
    # the simulation has teeth: testing at alpha at every look without spending rejects far more often
    naive, _, _ = _simulate(H0, 500, 5, sims, seed=20261205, alpha=alpha, naive=True)
    print(f"H0, exact McNemar at alpha at each of 5 looks: rejection {naive:.4f}")
    assert naive > alpha + slack


def test_sequential_stop_saves_episodes_under_a_large_difference():
    # success 0.5 (A) against 0.8 (B): A only 0.05, B only 0.35
    rate, used, fixed = _simulate((0.45, 0.05, 0.35, 0.15), 500, 5, 1000, seed=7)
    print(f"0.5 vs 0.8: sequential power {rate:.3f} with {used:.1f} of 500 pairs on average, fixed-sample {fixed:.3f}")
    assert rate >= 0.99 and used <= 0.35 * 500
    # a moderate one, 0.5 against 0.6 (A only 0.1, B only 0.2): little power lost, episodes still saved
    rate, used, fixed = _simulate((0.4, 0.1, 0.2, 0.3), 500, 5, 1000, seed=8)
    print(f"0.5 vs 0.6: sequential power {rate:.3f} with {used:.1f} of 500 pairs on average, fixed-sample {fixed:.3f}")
    assert rate >= fixed - 0.03 and used <= 0.8 * 500


def test_the_statistics_import_neither_torch_nor_ray():
    code = ("import sys, embodirl.runner.paired\n"
            "print(sorted(m for m in ('torch', 'ray', 'scipy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
