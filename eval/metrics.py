"""Accuracy (lm-eval's acc / acc_norm / stderr), TTFT percentiles, and paired differences."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def predictions(loglikelihoods: Sequence[float], choices: Sequence[str]) -> tuple[int, int]:
    """(argmax of loglikelihood, argmax of loglikelihood per UTF-8 byte of the choice).

    lm-eval normalises by the length of the choice string without the target delimiter
    (`len(choice)` in 0.4.x, equal to the byte length on ASCII text); bytes are used here.
    """
    lls = np.asarray(loglikelihoods, dtype=np.float64)
    lengths = np.array([max(1, len(c.encode("utf-8"))) for c in choices], dtype=np.float64)
    return int(np.argmax(lls)), int(np.argmax(lls / lengths))


def mean_stderr(values: Sequence[float]) -> float:
    """Standard error of the mean with the sample (n-1) deviation, as lm-eval's `mean_stderr`."""
    n = len(values)
    if n < 2:
        return float("nan")
    return float(np.std(np.asarray(values, dtype=np.float64), ddof=1) / math.sqrt(n))


def accuracy(outcomes: Sequence[tuple[Sequence[float], Sequence[str], int]]) -> dict:
    """outcomes: (choice loglikelihoods, choice strings, gold) per request."""
    correct, correct_norm = [], []
    for lls, choices, gold in outcomes:
        pred, pred_norm = predictions(lls, choices)
        correct.append(float(pred == gold))
        correct_norm.append(float(pred_norm == gold))
    n = len(correct)
    return {
        "acc": float(np.mean(correct)) if n else float("nan"),
        "acc_norm": float(np.mean(correct_norm)) if n else float("nan"),
        "stderr": mean_stderr(correct),
        "acc_norm_stderr": mean_stderr(correct_norm),
        "n": n,
    }


def per_request_correct(outcomes: Sequence[tuple[Sequence[float], Sequence[str], int]]) -> np.ndarray:
    return np.array([float(predictions(lls, ch)[0] == gold) for lls, ch, gold in outcomes])


def latency_summary(values_ms: Sequence[float]) -> dict:
    """mean / p50 / p95 / p99 (linear interpolation between order statistics)."""
    x = np.asarray(values_ms, dtype=np.float64)
    if x.size == 0:
        return {"mean": float("nan"), "p50": float("nan"), "p95": float("nan"), "p99": float("nan")}
    p50, p95, p99 = np.percentile(x, [50, 95, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


def paired_difference(correct: Sequence[float], reference: Sequence[float]) -> dict:
    """Accuracy of a system minus the reference's on the same requests, with a paired stderr.

    `only_system` / `only_reference` count requests that exactly one of the two gets right
    (McNemar's discordant pairs): the difference is (only_system - only_reference) / n.
    """
    a = np.asarray(correct, dtype=np.float64)
    b = np.asarray(reference, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired difference needs equal lengths, got {a.shape} and {b.shape}")
    d = a - b
    return {
        "acc_diff": float(d.mean()) if d.size else float("nan"),
        "stderr": mean_stderr(d),
        "n": int(d.size),
        "only_system": int(np.sum(d > 0)),
        "only_reference": int(np.sum(d < 0)),
    }
