"""`prompt_selection="importance"` targets the uniform objective under every TRL `loss_type`: the loss types are read
from TRL's own `_compute_loss`, each one's normaliser is classified by running that loss, and the config's handling
(exact, weighted token count, refused) must match; the weighted token count reaches TRL's batch; the weights reaching
the estimator are the draw's 1 / (n q) row by row; the loss terms the weights cannot reach are refused; the exact
enumeration in benchmarks/importance-normaliser/ is what its script computes."""

import ast
import importlib.util
import inspect
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from trl import GRPOTrainer

from poise_trl import POISEConfig, POISETrainer
from poise_trl.grpo import selection as selection_module
from poise_trl.sampling import IMPORTANCE_LOSS_TYPES, importance_probabilities, importance_weights

from .conftest import CPU_ARGS, digit_dataset, digit_reward, poise_args, spy_batch_advantages

G = 2
ENUMERATION = Path(__file__).resolve().parents[1] / "benchmarks" / "importance-normaliser"


def trl_loss_types() -> list[str]:
    """Every `loss_type` TRL's `_compute_loss` branches on: the string constants compared with `self.loss_type`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(GRPOTrainer._compute_loss)))
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Compare) and ast.unparse(node.left) == "self.loss_type"):
            continue
        for comparator in node.comparators:
            elements = comparator.elts if isinstance(comparator, ast.List | ast.Tuple | ast.Set) else [comparator]
            found += [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return sorted(set(found))


def test_the_loss_types_are_read_from_trl():
    types = trl_loss_types()
    assert {"grpo", "dapo", "bnpo", "dr_grpo"} <= set(types)  # the reader works on this TRL
    assert set(IMPORTANCE_LOSS_TYPES) <= set(types), "a loss type POISE handles is gone from TRL"


def _loss(trainer, loss_type: str, advantages, completion_mask, num_items) -> float:
    """TRL's own `_compute_loss` under `loss_type` on a fixed 4-row batch (on-policy: no old log-probs)."""
    trainer.loss_type = loss_type
    trainer.importance_sampling_level = "sequence" if loss_type == "luspo" else "token"
    g = torch.Generator().manual_seed(0)
    rows, width = completion_mask.shape
    inputs = {
        "prompt_ids": torch.randint(3, 30, (rows, 3), generator=g),
        "prompt_mask": torch.ones(rows, 3, dtype=torch.long),
        "completion_ids": torch.randint(3, 30, (rows, width), generator=g),
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": torch.tensor(num_items),
    }
    with torch.no_grad():
        return trainer._compute_loss(trainer.model, inputs).item()


def classify(trainer, loss_type: str) -> str:
    """What `loss_type`'s normaliser reads, found by running TRL's loss: another row's length (that row's advantage
    0) moves it -> "micro-batch token count"; `num_items_in_batch` moves it -> "weighted token count" (what POISE
    weights); neither -> "constant"."""
    advantages = torch.tensor([0.7, -0.4, 0.3, 0.0])
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 6])
    shorter = mask.clone()
    shorter[3, 2:] = 0  # the zero-advantage row's length: only a normaliser can see it
    base = _loss(trainer, loss_type, advantages, mask, 21)
    if abs(_loss(trainer, loss_type, advantages, shorter, 21) - base) > 1e-7 * abs(base):
        return "micro-batch token count"
    if abs(_loss(trainer, loss_type, advantages, mask, 42) - base) > 1e-7 * abs(base):
        return "weighted token count"
    return "constant"


def homogeneity_gap(trainer, loss_type: str) -> float:
    """|loss(w * A) - sum_i w_i loss(A on row i only)| / |loss(w * A)|: 0 when a row's positive weight may multiply
    its advantages (the loss is positively homogeneous in them, row by row)."""
    weights = torch.tensor([0.5, 2.0, 1.3, 0.8])
    advantages = torch.tensor([0.7, -0.4, 0.3, -0.9])
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 5 + [0], [1] * 3 + [0] * 3])
    whole = _loss(trainer, loss_type, advantages * weights, mask, 18)
    rows = [_loss(trainer, loss_type, advantages * torch.eye(4)[i], mask, 18) for i in range(4)]
    return abs(whole - sum(w * r for w, r in zip(weights.tolist(), rows, strict=True))) / abs(whole)


@pytest.fixture(scope="module")
def normalisers(tiny_model_path, tmp_path_factory) -> dict[str, tuple[str, float]]:
    """Every TRL loss type's (normaliser kind, homogeneity gap), from one trainer, before any other config is built
    (building a `TrainingArguments` resets accelerate's state, which the trainer's passes need)."""
    args = poise_args(tmp_path_factory.mktemp("objective"), per_device_train_batch_size=4)
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return {name: (classify(trainer, name), homogeneity_gap(trainer, name)) for name in trl_loss_types()}


@pytest.mark.parametrize("loss_type", trl_loss_types())
def test_every_trl_loss_type_is_handled_by_what_its_normaliser_reads(normalisers, tmp_path, loss_type):
    kind, gap = normalisers[loss_type]
    assert gap < 1e-5  # a row's weight may multiply its advantages under every loss
    level = "sequence" if loss_type == "luspo" else "token"
    settings = dict(CPU_ARGS, output_dir=str(tmp_path), loss_type=loss_type, importance_sampling_level=level)
    if kind == "micro-batch token count":
        assert loss_type not in IMPORTANCE_LOSS_TYPES
        with pytest.raises(ValueError, match="'dapo'") as refused:
            POISEConfig(**settings, prompt_selection="importance")
        assert all(f"'{name}'" in str(refused.value) for name in IMPORTANCE_LOSS_TYPES)
    else:
        assert IMPORTANCE_LOSS_TYPES.get(loss_type) == kind, f"TRL's {loss_type!r} divides by a {kind}"
        POISEConfig(**settings, prompt_selection="importance")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(beta=0.1), "beta=0.1: the KL penalty does not see the advantages"),
        (dict(entropy_coef=0.01), "entropy_coef=0.01: the entropy bonus"),
        (dict(use_adaptive_entropy=True), "use_adaptive_entropy=True: the entropy bonus"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile=0.2: the top-entropy token mask"),
        (dict(loss_type="bnpo"), "loss_type='bnpo'.*'grpo', 'dr_grpo', 'sapo', 'luspo', 'dapo', 'cispo', 'vespo'"),
    ],
)
def test_the_terms_the_weights_cannot_reach_are_refused(tmp_path, overrides, message):
    settings = dict(CPU_ARGS, output_dir=str(tmp_path), **overrides)
    with pytest.raises(ValueError, match=message):
        POISEConfig(**settings, prompt_selection="importance")
    POISEConfig(**settings)  # without the sampler, TRL's settings stay TRL's
    POISEConfig(**settings, prompt_selection="value")  # the biased rule claims no uniform objective


class Drawn(POISETrainer):
    """Records each step's candidates, the values the rule saw, the kept rows, TRL's token count and POISE's."""

    def _select_prompts(self, inputs, step):
        kept = super()._select_prompts(inputs, step)
        self.records.append({"candidates": [x["prompt"] for x in inputs][::G], "kept": [x["prompt"] for x in kept]})
        return kept

    def _weighted_token_count(self, output, weights):
        count = super()._weighted_token_count(output, weights)
        mask = output["completion_mask"]
        mask = mask if output.get("tool_mask") is None else mask * output["tool_mask"]
        self.records[-1].update(trl=output["num_items_in_batch"].clone(), weighted=count, tokens=mask.sum(1))
        return count

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        self.records[-1]["output"] = output["num_items_in_batch"].clone()
        return output


def test_the_estimator_gets_each_rows_1_over_nq_and_the_loss_the_weighted_token_count(
    tiny_model_path, tmp_path, monkeypatch
):
    """Single process: the weights handed to `estimator.advantages` are, on every row, 1 / (n q(x)) of that row's
    prompt x, q recomputed from the values the rule was given; TRL's `num_items_in_batch` becomes the rows' tokens
    weighted alike, the weights rescaled to sum to the rows (unchanged while the draws are uniform)."""
    args = poise_args(
        tmp_path, max_steps=4, per_device_train_batch_size=4, prompt_selection="importance", probe_warmup_steps=1
    )
    trainer = Drawn(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.records, seen, applied = [], [], []
    draw = selection_module.draw

    def recorded_draw(rule, candidates, keep, values=None, reward_range=None, **kwargs):
        seen.append((None if values is None else values.clone(), reward_range, rule.floor))
        return draw(rule, candidates, keep, values, reward_range, **kwargs)

    advantages = trainer.estimator.advantages

    def recorded_advantages(args, kwargs, result):
        features, rollouts = args
        plain = advantages(features, replace(rollouts, weights=None), **kwargs).advantages
        applied.append((rollouts.weights.clone(), plain, result.advantages))

    monkeypatch.setattr(selection_module, "draw", recorded_draw)
    spy_batch_advantages(trainer, monkeypatch, recorded_advantages)
    trainer.train()
    assert len(seen) == len(applied) == len(trainer.records) == 4
    drawn_steps = 0
    for (values, reward_range, floor), (weights, plain, weighted), record in zip(
        seen, applied, trainer.records, strict=True
    ):
        if values is None:  # untrusted: uniform, weight 1
            expected = torch.ones(len(record["kept"]), dtype=torch.float64)
        else:
            drawn_steps += 1
            low, high = (float(b) for b in reward_range)
            q = importance_probabilities(values.double(), low, high, floor)
            by_prompt = dict(zip(record["candidates"], importance_weights(q).tolist(), strict=True))
            expected = torch.tensor([by_prompt[prompt] for prompt in record["kept"]], dtype=torch.float64)
        torch.testing.assert_close(weights.double(), expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(weighted, plain * weights.to(plain.dtype))
        tokens = record["tokens"].double()
        assert record["output"] == record["weighted"]
        self_normalised = (tokens * expected).sum() * len(expected) / expected.sum()
        assert record["weighted"].item() == pytest.approx(self_normalised.item(), rel=1e-6)
        if values is None:
            assert record["weighted"].item() == record["trl"].item()
    assert drawn_steps >= 2 and any(len(set(w.tolist())) > 1 for w, _, _ in applied)


def _enumeration():
    spec = importlib.util.spec_from_file_location("enumerate_normaliser", ENUMERATION / "enumerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_enumeration_is_what_its_script_computes():
    """The k = 4 rows of benchmarks/importance-normaliser/results.md (the issue's setting: 8 candidates, 4 draws,
    G = 2, lengths 40-300), recomputed: exact (0) under the constant normalisers."""
    module = _enumeration()
    committed = {}
    for line in (ENUMERATION / "results.md").read_text().splitlines()[2:]:
        k, family, rule, *figures = (cell.strip() for cell in line.strip("|").split("|"))
        committed[(k, family, rule)] = [float(x) for x in figures]
    for correlated, family in ((False, "independent"), (True, "rise with difficulty")):
        for rule, row in module.summary(4, correlated).items():
            expected = [row["median"], row["p95"], row["max"], row["cos_min"]]
            assert committed[("4", family, rule)] == pytest.approx(expected, abs=6e-5)
            if rule in ("grpo", "dr_grpo"):
                assert row["max"] < 1e-12
    # the weighted counts' differences shrink with the batch, the unweighted count's does not vanish, and the
    # self-normalised count (the trainer's) is the nearest at every k, median and 95th percentile
    for family in ("independent", "rise with difficulty"):
        for rule in ("dapo_weighted", "dapo_self_normalised"):
            medians = [committed[(k, family, rule)][0] for k in ("4", "8", "16", "k -> inf")]
            assert medians == sorted(medians, reverse=True) and medians[-1] == 0
        assert committed[("k -> inf", family, "dapo_unweighted")][0] > 0
        for k in ("4", "8", "16"):
            used = committed[(k, family, "dapo_self_normalised")]
            for other in ("dapo_unweighted", "dapo_weighted"):
                assert used[0] < committed[(k, family, other)][0] and used[1] < committed[(k, family, other)][1]
