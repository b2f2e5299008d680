"""Which rows carry a known cumulative label in the offline STS fit, on traces pruned by the scheduler.

Pruned traces (v < K, with v chosen from the confidences before verification) are what a capacity
manager records. The fit uses position k's cumulative label exactly where k was verified (k <= v): the
selection depends on v only, so it is unbiased given the confidences. Also counting the rows past v
whose rejection was observed (a < v) looks like free extra data but selects on the outcome: each such
row is a known 0 while its a == v siblings stay unknown, so survival past v is under-estimated.
"""

from __future__ import annotations

import math

import numpy as np

from dspark_cli.core.sts import cumulative_labels, cumulative_survival, fit_sts

T_STAR = [2.0, 0.5, 1.5, 2.5]


def pruned_traces(seed: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows whose verified count comes from the head's own survival (survival >= 0.35), like a threshold
    scheduler; returns conf, verified, accepted and the true cumulative survival."""
    rng = np.random.default_rng(seed)
    k = len(T_STAR)
    logit = rng.normal(1.5, 2.0, size=(n, k))
    conf = 1.0 / (1.0 + np.exp(-logit))
    p_true = 1.0 / (1.0 + np.exp(-logit / np.array(T_STAR)))
    accept = rng.random((n, k)) < p_true
    run = np.argmin(np.c_[accept, np.zeros((n, 1), dtype=bool)], axis=1)
    verified = (np.cumprod(conf, axis=1) >= 0.35).sum(axis=1)
    return conf, verified, np.minimum(run, verified), np.cumprod(p_true, axis=1)


def test_pruned_traces_are_really_pruned_and_the_fit_recovers_t_star() -> None:
    conf, v, a, _ = pruned_traces(0, 60000)
    k = conf.shape[1]
    assert (v < k).mean() > 0.4 and (v == k).mean() > 0.2  # a real mix of pruned and full rows
    fit = fit_sts(conf, v, a)
    assert fit.rows_per_position == [int((v >= j).sum()) for j in range(1, k + 1)]
    for j, t in enumerate(T_STAR):
        assert abs(math.log(fit.temperatures[j] / t)) < 0.25, fit.temperatures
        assert fit.ece_after[j] * 3 <= fit.ece_before[j], (fit.ece_before, fit.ece_after)


def test_known_rows_are_unbiased_and_the_observed_rejection_extension_is_not() -> None:
    conf, v, a, true_surv = pruned_traces(1, 60000)
    k = conf.shape[1]
    known, label = cumulative_labels(v, a, k)
    extension = (a < v)[:, None] & ~known  # rows past v whose rejection was seen: label surely 0
    for j in range(1, k):
        m = known[:, j]
        se = math.sqrt(0.25 / m.sum())
        # Unbiased: the observed rate matches the true survival on the same rows.
        assert abs(label[m, j].mean() - true_surv[m, j].mean()) < 4 * se
        e, mx = extension[:, j], m | extension[:, j]
        # Biased: the added rows are all labelled 0 although ~15% of them truly survive, which drags
        # the rate well below the truth (many standard errors).
        assert label[e, j].max() == 0.0 and true_surv[e, j].mean() > 0.1
        assert label[mx, j].mean() < true_surv[mx, j].mean() - 4 * math.sqrt(0.25 / mx.sum())


def test_cumulative_survival_matches_the_temperature_formula() -> None:
    conf = np.array([[0.9, 0.5, 0.2]])
    assert np.allclose(cumulative_survival(conf), [[0.9, 0.45, 0.09]])
    t = [2.0, 1.0, 0.5]
    logit = np.log(conf / (1 - conf))
    expect = np.cumprod(1 / (1 + np.exp(-logit / np.array(t))), axis=1)
    assert np.allclose(cumulative_survival(conf, t), expect)
