"""Two CPU processes (gloo) against one on the same global batch, with a group straddling the two ranks."""

from pathlib import Path

import pytest

from .distributed.launch import launch

SCRIPT = Path(__file__).parent / "distributed" / "poise_ranks.py"


def _launch(tiny_model_path: Path, out: Path, processes: int) -> list[dict]:
    # 2 processes x 3 rows with G=2: rows 0-2 on rank 0 and 3-5 on rank 1, so group (2, 3) straddles the ranks.
    return launch(SCRIPT, [str(tiny_model_path), str(out), str(6 // processes)], out, processes)


@pytest.fixture(scope="module")
def runs(tiny_model_path, tmp_path_factory) -> dict[int, list[dict]]:
    return {n: _launch(tiny_model_path, tmp_path_factory.mktemp(f"ranks{n}"), n) for n in (1, 2)}


def test_ranks_hold_identical_probe_parameters(runs):
    rank0, rank1 = runs[2]
    assert len(rank0["steps"]) == 3
    for step0, step1 in zip(rank0["steps"], rank1["steps"], strict=True):
        assert step0["probe"] == step1["probe"]  # exact, after broadcast
        assert step0["baselines"] == step1["baselines"]


def test_two_processes_match_one_process(runs):
    (single,), (rank0, rank1) = runs[1], runs[2]
    for s, r0, r1 in zip(single["steps"], rank0["steps"], rank1["steps"], strict=True):
        # Each rank pads its own rows (a different prompt width) and runs a smaller batch, and DDP reduces gradients in
        # another order, so features differ by float32 rounding (~1e-7), which the probe's standardisation and solve
        # on a handful of rows amplify to ~1e-5 (measured: up to 2.5e-5, with or without updates). A pairing or
        # gathering error would move advantages by ~0.1-1, three orders of magnitude above this tolerance.
        advantages = r0["advantages"] + r1["advantages"]
        assert advantages == pytest.approx(s["advantages"], abs=2e-4)
        assert r0["baselines"] == pytest.approx(s["baselines"], abs=2e-4, nan_ok=True)
        assert any(a != 0 for a in s["advantages"])
    first = single["steps"][0]
    assert rank0["steps"][0]["advantages"] + rank1["steps"][0]["advantages"] == first["advantages"]


@pytest.fixture(scope="module")
def prefix_runs(tiny_model_path, tmp_path_factory) -> dict[int, list[dict]]:
    """probe_granularity="prefix", trusted after one step: steps 2 and 3 train on token advantages. The release
    preset (alpha 100, PCA): the paper's alpha 0.01 on 24-48 rows of 261 features turns the float32 rounding of a
    different padding into token-advantage differences of ~1e-2 (measured), which would hide what this checks."""
    return {
        n: launch(SCRIPT, [str(tiny_model_path), str(out), str(6 // n), "prefix", "release"], out, n)
        for n in (1, 2)
        for out in [tmp_path_factory.mktemp(f"prefix{n}")]
    }


def test_per_prefix_baseline_on_two_processes_matches_one_process(prefix_runs):
    """Each rank's token advantages cover its own completion width; the sampled tokens the prefix probe learns from
    are drawn for the global batch, so two processes fit the probe one process fits (drawn per rank, they differed
    by up to 0.57, the largest advantage), and both ranks hold it exactly."""
    (single,), (rank0, rank1) = prefix_runs[1], prefix_runs[2]
    assert "token_advantages" not in single["steps"][0]  # untrusted at step 1: sequence-level advantages
    for s, r0, r1 in zip(single["steps"][1:], rank0["steps"][1:], rank1["steps"][1:], strict=True):
        assert r0["prefix_probe"] == r1["prefix_probe"]  # exact, after the broadcast
        tokens = r0["token_advantages"] + r1["token_advantages"]
        assert [len(row) for row in tokens] == [len(row) for row in s["token_advantages"]]
        for row, expected in zip(tokens, s["token_advantages"], strict=True):
            assert row == pytest.approx(expected, abs=2e-4)
        assert any(len(set(row)) > 1 for row in tokens)  # the values vary along the completions


def test_two_processes_read_the_loss_forward_as_their_own_pass_would(tiny_model_path, tmp_path):
    """Whole groups on each rank (4 rows, G=2): on two gloo processes the loss route gives, rank by rank, the
    advantages TRL's loss read, the baselines and the probe of POISE's own pass."""
    runs = {
        capture: launch(SCRIPT, [str(tiny_model_path), str(out), "4", "sequence", "paper", capture], out, 2)
        for capture in ("auto", "pass")
        for out in [tmp_path / capture]
    }
    for loss, own in zip(runs["auto"], runs["pass"], strict=True):
        assert [s["route"] for s in loss["steps"]] == ["loss"] * 3
        assert [s["route"] for s in own["steps"]] == ["own_pass"] * 3
        assert len(loss["loss_reads"]) == 3
        for step, (read, expected) in enumerate(zip(loss["loss_reads"], own["loss_reads"], strict=True)):
            assert read == expected, f"step {step + 1}: the loss read other advantages than the own pass's"
        for a, b in zip(loss["steps"], own["steps"], strict=True):
            assert a["advantages"] == b["advantages"] and a["probe"] == b["probe"]
            assert a["baselines"] == pytest.approx(b["baselines"], abs=0, nan_ok=True)
    assert any(row[2] != 0 for rank in runs["auto"] for read in rank["loss_reads"][1:] for row in read)


ESTIMATOR_SCRIPT = Path(__file__).parent / "distributed" / "estimator_ranks.py"
LAYER_CHOICE_TRANSFERS = 3  # the step's one, the buffer's prompt ids (to draw the folds), the broadcast errors


def test_two_processes_cost_one_transfer_per_step_and_agree(tmp_path):
    """The probe is broadcast on its device (no round trip through the host); a step that chooses the layer adds
    only what the K-fold choice itself reads, and the ranks end with identical probes."""
    rank0, rank1 = launch(ESTIMATOR_SCRIPT, [str(tmp_path)], tmp_path, 2)
    assert rank0["probe"] == rank1["probe"]
    for step in rank0["counts"]:
        choosing = step["step"] % 2 == 0
        assert step["transfers"] == (LAYER_CHOICE_TRANSFERS if choosing else 1), step


def test_two_processes_keep_the_same_prompt_history_without_a_broadcast(tmp_path):
    """Every rank updates the history from the same gathered batch, with fixed-order sums: identical tables, and a
    step still costs one transfer."""
    rank0, rank1 = launch(ESTIMATOR_SCRIPT, [str(tmp_path), "history"], tmp_path, 2)
    assert rank0["history"] == rank1["history"] and max(rank0["history"]["history.count"]) > 2
    assert rank0["probe"] == rank1["probe"]
    for step in rank0["counts"]:
        assert step["transfers"] == (LAYER_CHOICE_TRANSFERS if step["step"] % 2 == 0 else 1), step
