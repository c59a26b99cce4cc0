"""The learning-curve arithmetic of `poise-trl bench efficiency`: AUC over completions generated, completions to a
target gain, and the interpolation both use (the statistics over seeds are `bench.report`'s)."""

from itertools import pairwise
from typing import Any


def completions_to_gain(run: dict[str, Any], gain: float) -> float | None:
    """Completions generated when held-out avg@k first reaches the seed's starting accuracy + `gain`, linearly
    interpolated between evaluations; None if it never does. Per seed, because warm starts differ in starting accuracy
    more than contenders do."""
    target = run["avg_at_k"][0] + gain
    points = list(zip(run["eval_completions"], run["avg_at_k"], strict=True))
    if points[0][1] >= target:
        return float(points[0][0])
    for (c0, a0), (c1, a1) in pairwise(points):
        if a1 >= target:  # a0 < target: the curve crosses within this interval
            return c0 + (target - a0) / (a1 - a0) * (c1 - c0)
    return None


def interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """The piecewise-linear curve through (xs, ys) at x (xs increasing, x within them)."""
    for (x0, y0), (x1, y1) in pairwise(zip(xs, ys, strict=True)):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return ys[-1]


def normalized_auc(run: dict[str, Any], budget: float) -> float:
    """Mean held-out avg@k over the first `budget` completions generated: the area under the linearly interpolated
    curve divided by the budget. One number per run that uses every evaluation, not one threshold crossing."""
    xs, ys = run["eval_completions"], run["avg_at_k"]
    if budget <= 0 or xs[-1] < budget:
        raise ValueError(f"the run covers {xs[-1]} completions, not the budget {budget}")
    points = [(x, y) for x, y in zip(xs, ys, strict=True) if x < budget] + [(budget, interpolate(xs, ys, budget))]
    area = sum((x1 - x0) * (y0 + y1) / 2 for (x0, y0), (x1, y1) in pairwise(points))
    return area / budget
