"""The rollout scalars (columns.py) against a direct computation of the official code's formulas on Python lists, one
row at a time: every entry of the table, on hand-built rows and (test_properties.py) on generated ones."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poise_trl.features.columns import DEFAULT_SCALARS, SCALARS, scalar_columns
from poise_trl.features.features import feature_spans
from poise_trl.tiny import build_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MARKER = [7, 8]
TOKENIZER = build_tiny_tokenizer()  # for the scalars that read the decoded text


def _entropy_stats(values: list[float]) -> dict[str, float]:
    """holi-lab/POISE, src/poise/trainer.py `RayPOISETrainer._entropy_stats`: 0.0 for every statistic of an empty
    span."""
    if not values:
        return {"mean": 0.0, "last": 0.0, "max": 0.0, "min": 0.0}
    return {"mean": sum(values) / len(values), "last": values[-1], "max": max(values), "min": min(values)}


def _unique_ratio(ids: list[int]) -> float | None:
    return len(set(ids)) / len(ids) if ids else None


def reference_scalars(entropies: list[float], ids: list[int], spans: dict[str, list[int]]) -> dict[str, float]:
    """Every scalar of one row as holi-lab/POISE computes it (trainer.py `_rollout_entropy_features`; estimator.py
    `SingleTrajectoryFeatureBuilder.build_inputs`: a ratio of an empty text is None, read as 0.0), with a span's
    token ids for its words. `spans` maps "output", "reasoning" and "answer" to the row's positions."""
    out = {}
    for span, positions in spans.items():
        for stat, value in _entropy_stats([entropies[p] for p in positions]).items():
            out[f"{span}_{stat}_token_entropy"] = value
    tokens = {span: [ids[p] for p in positions] for span, positions in spans.items()}
    length = len(tokens["output"])
    unique = {span: _unique_ratio(tokens[span]) for span in spans}
    repetition = {span: None if unique[span] is None else 1.0 - unique[span] for span in ("output", "reasoning")}
    out.update(
        output_length=length,
        think_tokens=len(tokens["reasoning"]),
        answer_tokens=len(tokens["answer"]),
        think_ratio=len(tokens["reasoning"]) / max(length, 1),
        answer_ratio=len(tokens["answer"]) / max(length, 1),
        **{f"{span}_unique_token_ratio": unique[span] or 0.0 for span in spans},
        **{f"{span}_repetition_ratio": repetition[span] or 0.0 for span in repetition},
    )
    out["entropy_gap_reasoning_answer"] = out["reasoning_mean_token_entropy"] - out["answer_mean_token_entropy"]
    out["answer_entropy_gap_vs_output"] = out["answer_mean_token_entropy"] - out["output_mean_token_entropy"]
    out["unique_gap_reasoning_output"] = out["reasoning_unique_token_ratio"] - out["output_unique_token_ratio"]
    out["repetition_gap_reasoning_output"] = out["reasoning_repetition_ratio"] - out["output_repetition_ratio"]
    return out


def assert_matches_reference(columns: torch.Tensor, entropies: torch.Tensor, spans) -> None:
    """`columns` (B, len(SCALARS)) equal `reference_scalars` of each row where it computes them (entropies made
    finite, as the features): the official code's scalars, every one of which is in the table."""
    finite = entropies.float().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    masks = {"output": spans.completion_mask, "reasoning": spans.reasoning_mask, "answer": spans.answer_mask}
    for row in range(columns.size(0)):
        positions = {span: mask[row].nonzero().flatten().tolist() for span, mask in masks.items()}
        expected = reference_scalars(finite[row].tolist(), spans.completion_ids[row].tolist(), positions)
        computed = [columns[row, list(SCALARS).index(name)] for name in expected]
        torch.testing.assert_close(torch.stack(computed), torch.tensor(list(expected.values())), rtol=1e-5, atol=1e-5)


def test_every_scalar_matches_the_official_formula_on_hand_built_rows():
    """A marker in the middle (reasoning, then answer), no marker (the answer is the last n tokens), repeated
    tokens, a tool result the policy did not write, NaN entropies, and an empty completion."""
    completions = [[3, 3, 4, 7, 8, 5, 5, 5], [2, 9, 2, 9, 2], [6, 4, 7, 8, 6, 6], [1]]
    lengths = [8, 5, 6, 0]
    width = max(map(len, completions))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    generated = torch.ones_like(completion_mask)
    generated[2, 1] = 0  # a tool result inside the third completion
    spans = feature_spans(torch.ones(4, 2), ids, completion_mask, 3, MARKER, generated, TOKENIZER)
    entropies = torch.arange(4 * width, dtype=torch.float32).view(4, width).remainder(7.0) * 0.5
    entropies[0, 5] = math.nan
    columns = scalar_columns(list(SCALARS), entropies, spans)
    assert columns.shape == (4, len(SCALARS)) and columns.dtype == torch.float32 and columns.isfinite().all()
    assert_matches_reference(columns, entropies, spans)
    assert columns[3].eq(0).all()  # an empty completion: every statistic 0, as the official code's
    by_name = dict(zip(SCALARS, columns[0].tolist(), strict=True))
    assert by_name["think_tokens"] == 5 and by_name["answer_tokens"] == 3  # reasoning ends with the marker
    assert by_name["output_repetition_ratio"] == pytest.approx(1 - 5 / 8)  # 3, 4, 7, 8, 5 distinct of 8


def test_the_default_is_the_paper_three_and_a_subset_is_those_columns_in_order():
    assert DEFAULT_SCALARS == (
        "output_mean_token_entropy",
        "reasoning_mean_token_entropy",
        "answer_mean_token_entropy",
    )
    ids = torch.tensor([[3, 4, 7, 8, 5]])
    spans = feature_spans(torch.ones(1, 1), ids, torch.ones(1, 5), 2, MARKER, tokenizer=TOKENIZER)
    entropies = torch.tensor([[1.0, 2.0, 3.0, 10.0, 20.0]])
    everything = scalar_columns(list(SCALARS), entropies, spans)
    names = ["answer_last_token_entropy", "output_length", "output_min_token_entropy"]
    picked = scalar_columns(names, entropies, spans)
    assert torch.equal(picked, everything[:, [list(SCALARS).index(name) for name in names]])
    assert picked.tolist() == [[20.0, 5.0, 1.0]]


def test_the_scalar_table_imports_no_torch():
    """The command lines list the scalars: the table loads without torch (its computations call tensor methods)."""
    code = "import sys\nimport poise_trl.features.columns\nprint('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr
