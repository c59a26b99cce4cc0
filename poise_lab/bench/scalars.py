"""`poise-trl bench scalars`: does a rollout scalar in the probe's row lower the value's error? The exact instrument
of `bench gradient`, on one of its pools, with the probe's row as the only change.

Each variant appends its columns, a function of the pool's stored tensors (`PoolRollouts`), to the probe's default
row (the blocks of `POISEConfig.probe_features` at the pool's layer and window), or puts them in the place of the
row's scalar blocks (`Variant.replace`); the columns after the hidden-state blocks sit in no PCA block. The probe
is fitted as `bench gradient` fits its separate-pool rows (`gradient.fitted_probe`, with each of `--probes`' settings,
`probes.PROBES`: POISE (paper)'s and POISE (default)'s unless asked, observed in steps on the probe's pool; a probe
whose `probe_scalars` are not the pool's stored three has its own default row, `own_row`), and each measured
rollout's value serves its partner (G = 2). Reported per row, with 95% percentile intervals over `bench gradient`'s
bootstrap resamples of the prompts (the same seed):

- M, the value's error: the row's variance per completion minus the oracle baseline's (the true success rate), in
  units of W (B tr Cov = W + M + 2 Bv, the same W and Bv for every row), and its paired difference against the same
  settings' default row over the same resamples;
- held-out r: the Pearson r of each measured prompt's mean value with its success rate over its K rollouts (the
  probe never saw these prompts), and its paired difference;
- with `--against`, both paired differences against that one row too (e.g. every probe against the POISE authors'
  recipe).

A trained snapshot's pool that keeps the run's saved estimator shows it too, with its own row as it ran: its buffer
holds the feature rows it learned from, not their tokens, so no column can be added to it without a run that
computes the column. Its r is not a held-out one where the pool's prompts are the run's training prompts.
"""

import argparse
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poise_trl.features.columns import DEFAULT_SCALARS, REFERENCE_SCALARS, SCALARS, scalar_columns
from poise_trl.features.features import HIDDEN_BLOCKS, FeatureSpans, feature_spans

from .common import DEMO_MODEL, format_table, write_json
from .exact import (
    PoolGram,
    bootstrap_counts,
    oracle_moments,
    pair_moments,
    summarize,
    truth_weights,
)
from .exact import point_and_interval as _interval
from .gradient import (
    PROBE_K,
    fitted_probe,
    probe_rows,
    probe_values,
    read_pool,
    rule_config,
    run_estimator,
    separate_prompts,
)
from .prefix_gradient import SUBSPACES
from .probes import DEFAULT_PROBES, PROBES
from .value.collect import Collection, Log

DEFAULT = "default"  # the variant without extra columns: every other variant's reference
RUN_ROW = "run"


@dataclass(frozen=True)
class PoolRollouts:
    """What a variant's columns are computed from, one row per rollout of a pool, prompt-major: the tensors a pool
    stores and its per-token record (`collect.CompletionTokens`), never its rewards."""

    prompt_ids: torch.Tensor  # (N, Lp) left-padded
    prompt_mask: torch.Tensor  # (N, Lp)
    completion_ids: torch.Tensor  # (N, Lc) right-padded, EOS included
    completion_mask: torch.Tensor  # (N, Lc) bool
    entropies: torch.Tensor  # (N, Lc) each token's entropy in the features' pass, 0 on padding
    logprobs: torch.Tensor  # (N, Lc) each token's log-probability in that pass, 0 on padding
    texts: list[str]  # each completion as the reward function read it
    spans: FeatureSpans  # the library's spans (whole completion, reasoning, answer) at the pool's window

    @classmethod
    def of(cls, collection: Collection, tokenizer: Any = None) -> "PoolRollouts":
        """The pool's rollouts; `tokenizer` (the sampling model's) is for the scalars that read the decoded text."""
        tokens = collection.tokens
        if tokens is None:
            raise SystemExit(
                "this pool holds no per-token record (pool.tokens.safetensors), which extra columns are computed "
                "from: add it with `poise-trl bench pool-tokens FOLDER`"
            )
        prompt_ids, prompt_mask = (t[collection.prompt_index] for t in (collection.prompt_ids, collection.prompt_mask))
        completion_ids, completion_mask = collection.completion_ids.long(), collection.completion_mask.bool()
        window = int(collection.meta["default_pool"])
        spans = feature_spans(prompt_mask, completion_ids, completion_mask, window, tokens.marker_ids, None, tokenizer)
        return cls(
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            tokens.entropies,
            tokens.logprobs,
            tokens.texts,
            spans,
        )


ColumnFn = Callable[[PoolRollouts], torch.Tensor]

ENTROPY12 = (
    "output_mean_token_entropy",
    "output_last_token_entropy",
    "output_max_token_entropy",
    "output_min_token_entropy",
    "reasoning_mean_token_entropy",
    "reasoning_last_token_entropy",
    "reasoning_max_token_entropy",
    "reasoning_min_token_entropy",
    "answer_mean_token_entropy",
    "answer_last_token_entropy",
    "answer_max_token_entropy",
    "answer_min_token_entropy",
)
"""The official code's 12 token-entropy statistics ({output, reasoning, answer} x {mean, last, max, min})."""

SCALAR_SETS: dict[str, tuple[str, ...]] = {
    "paper": DEFAULT_SCALARS,
    "entropy12": ENTROPY12,
    "length": ("output_length", "think_tokens", "answer_tokens", "think_ratio", "answer_ratio"),
    "repetition": (
        "output_unique_token_ratio",
        "reasoning_unique_token_ratio",
        "answer_unique_token_ratio",
        "output_repetition_ratio",
        "reasoning_repetition_ratio",
        "unique_gap_reasoning_output",
        "repetition_gap_reasoning_output",
    ),
    "reference": REFERENCE_SCALARS,
    "all": (
        *ENTROPY12,
        "output_length",
        "think_tokens",
        "answer_tokens",
        "think_ratio",
        "answer_ratio",
        "output_unique_token_ratio",
        "reasoning_unique_token_ratio",
        "answer_unique_token_ratio",
        "output_repetition_ratio",
        "reasoning_repetition_ratio",
        "entropy_gap_reasoning_answer",
        "answer_entropy_gap_vs_output",
        "unique_gap_reasoning_output",
        "repetition_gap_reasoning_output",
    ),
}
"""The groups of `poise_trl.features.columns.SCALARS` a `--probe-scalars` list may name, each listed name by name so
that a committed result's set keeps its meaning when the table grows: the paper's three, the official code's 12
token-entropy statistics, its 5 length features, its 7 repetition features (with their gaps), and all 26 scalars of its
release in the table's order. A scalar added to `SCALARS` joins no group by itself; a test asks that `all` list every
scalar, so adding one means choosing its groups (and re-measuring what `all` measured)."""


@dataclass(frozen=True)
class ScalarSet:
    """The columns a `POISEConfig.probe_scalars` list puts in the row, computed by the library's own call
    (`columns.scalar_columns`) from the pool's per-token record."""

    names: tuple[str, ...]

    @property
    def reads_text(self) -> bool:
        """Whether a scalar of the set cuts its span from the decoded text (needs the tokenizer)."""
        return any(SCALARS[name].reads_text for name in self.names)

    def __call__(self, rollouts: PoolRollouts) -> torch.Tensor:
        return scalar_columns(self.names, rollouts.entropies, rollouts.spans)


def scalar_set(spec: str) -> "Variant":
    """'NAME=ENTRY,ENTRY,...' -> the variant whose row holds those rollout scalars in the place of the default row's
    scalar blocks, as `probe_scalars` would lay them out; an entry is a scalar of `columns.SCALARS` or a group of
    `SCALAR_SETS`."""
    name, _, listed = spec.partition("=")
    entries = [entry for entry in listed.split(",") if entry]
    unknown = [entry for entry in entries if entry not in SCALARS and entry not in SCALAR_SETS]
    if not name or name == DEFAULT or not entries or unknown:
        raise SystemExit(
            f"{spec!r}: write NAME=ENTRY,ENTRY,... (NAME not {DEFAULT!r}), each entry a rollout scalar "
            f"({', '.join(SCALARS)}) or a group ({', '.join(SCALAR_SETS)})"
            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
        )
    names = [scalar for entry in entries for scalar in SCALAR_SETS.get(entry, (entry,))]
    return Variant(name, ScalarSet(tuple(dict.fromkeys(names))), replace=True)


@dataclass(frozen=True)
class Variant:
    """A probe row to measure: the default row followed by `columns(rollouts)`, (N, k) (None: the default row); with
    `replace`, the columns take the place of the row's scalar blocks (the entropy statistics, and the length where
    the row holds it) after its hidden-state blocks, as a list of scalars that leaves out the default three would."""

    name: str
    columns: ColumnFn | None = None
    replace: bool = False
    tokenizer: Any = None  # the sampling model's, for scalars that read the decoded text (`with_tokenizer`)

    @property
    def reads_text(self) -> bool:
        return isinstance(self.columns, ScalarSet) and self.columns.reads_text

    def rows(self, collection: Collection, blocks: Sequence[str]) -> torch.Tensor:
        """(N, D') the probe's input rows of `collection` (`gradient.Rows`)."""
        kept = [b for b in blocks if not self.replace or b in HIDDEN_BLOCKS]
        default = probe_rows(collection, kept)
        if self.columns is None:
            return default
        extra = self.columns(PoolRollouts.of(collection, self.tokenizer))
        n = collection.rewards.numel()
        if extra.dim() != 2 or extra.size(0) != n or not torch.isfinite(extra).all():
            raise ValueError(
                f"variant {self.name!r}: its columns must be ({n}, k) and finite, got {tuple(extra.shape)}"
                + ("" if extra.dim() != 2 or extra.size(0) != n else " with non-finite entries")
            )
        return torch.cat([default, extra.to(default.dtype)], dim=1)

    def describe(self) -> str:
        if self.columns is None:
            return "the default row"
        if isinstance(self.columns, ScalarSet):
            return f"the hidden blocks + probe_scalars={list(self.columns.names)}"
        return f"{'the hidden blocks' if self.replace else 'the default row'} + {qualified_name(self.columns)}"


def qualified_name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


def load_column_fn(spec: str, replace: bool = False) -> Variant:
    """'NAME=MODULE:FUNCTION' -> the variant whose columns that function computes (appended, or with `replace` in
    the place of the row's scalar blocks)."""
    name, _, target = spec.partition("=")
    module, _, attr = target.partition(":")
    if not (name and module and attr) or name == DEFAULT:
        raise SystemExit(
            f"{spec!r}: write NAME=MODULE:FUNCTION (NAME not {DEFAULT!r}), e.g. "
            "length=poise_lab.bench.scalars:completion_length"
        )
    try:
        return Variant(name, getattr(importlib.import_module(module), attr), replace)
    except (ImportError, AttributeError) as error:
        raise SystemExit(f"{spec!r}: {error}") from error


def load_tokenizer(name_or_path: str) -> Any:
    """The tokenizer `--tokenizer` names: the toy demo model's by `bench gradient`'s name of that model (its warm
    start trains the model, never the tokenizer: `poise_trl.tiny.build_tiny_tokenizer`), a real model's by its name
    (prepared from its package, `poise_lab.models.real`), or a model folder's."""
    if name_or_path == DEMO_MODEL:
        from poise_trl.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    from transformers import AutoTokenizer

    from poise_lab.models.real import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(name_or_path))


def with_tokenizer(variants: Sequence[Variant], path: str, needed: bool = False) -> list[Variant]:
    """The variants, given the tokenizer `path` names (`load_tokenizer`) when a `--probe-scalars` set reads the
    decoded text (the `text_*` scalars) or `needed` (a probe's own scalars do); loaded only then."""
    if not (needed or any(v.reads_text for v in variants)):
        return list(variants)
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"a probe row holds scalars cut from the decoded text, which need the tokenizer of the model that "
            f"sampled the pool; {path} gives none ({error}): give it with --tokenizer PATH"
        ) from error
    return [Variant(v.name, v.columns, v.replace, tokenizer) for v in variants]


def completion_length(rollouts: PoolRollouts) -> torch.Tensor:
    """(N, 1) the number of completion tokens, from the ids' mask alone."""
    return rollouts.completion_mask.sum(1, keepdim=True).float()


def entropy_stats(rollouts: PoolRollouts) -> torch.Tensor:
    """(N, 3) the mean, standard deviation and largest of each completion's token entropies, from the per-token
    record: the harness's example columns, computed here and not by the library."""
    mask = rollouts.spans.completion_mask
    count = mask.sum(1).clamp(min=1)
    mean = (rollouts.entropies * mask).sum(1) / count
    std = (((rollouts.entropies - mean[:, None]) ** 2 * mask).sum(1) / count).sqrt()
    return torch.stack([mean, std, torch.where(mask, rollouts.entropies, 0.0).amax(1)], dim=1)


def row_name(preset: str, variant: str) -> str:
    return f"{preset}:{variant}"


def label(row: str) -> str:
    if row == RUN_ROW:
        return "the run's saved estimator (its own row)"
    probe, variant = row.split(":")
    return f"{PROBES[probe].label} [{variant}]"


def own_scalars(probe: str, pool: Collection) -> tuple[str, ...]:
    """The rollout scalars `probe`'s settings put in its row (`POISEConfig.probe_scalars`)."""
    return tuple(rule_config(PROBES[probe].settings, pool).probe_scalars)


def own_row(variant: Variant, scalars: tuple[str, ...]) -> Variant:
    """`variant` for a probe whose row holds `scalars`: its default row is the probe's own, those scalars computed by
    the library in the place of the pool's stored statistics (the paper's three) where they differ."""
    if variant.name != DEFAULT or scalars == DEFAULT_SCALARS:
        return variant
    return Variant(DEFAULT, ScalarSet(scalars), replace=True, tokenizer=variant.tokenizer)


def fit_values(
    pool: Collection,
    probe: Collection,
    keep: np.ndarray,
    variants: Sequence[Variant],
    estimator_file: Path | None = None,
    log: Log = print,
    probes: Sequence[str] = DEFAULT_PROBES,
) -> dict[str, np.ndarray]:
    """Each row's value of every measured rollout: each of `probes` x variant fitted on the probe pool's prompts
    `keep` (a probe's default row is its own, `own_row`), and the run's saved estimator where `estimator_file` is
    given."""
    values = {}
    for name in probes:
        scalars = own_scalars(name, pool)
        for variant in variants:
            variant = own_row(variant, scalars)
            row = row_name(name, variant.name)
            estimator, blocks = fitted_probe(PROBES[name].settings, pool, probe, keep, rows=variant.rows)
            values[row] = probe_values(estimator, pool, variant.rows(pool, blocks), label(row))
            log(f"      {label(row)}: fitted on {len(keep)} prompts x {PROBE_K} rollouts")
    if estimator_file is not None:
        estimator, blocks = run_estimator(estimator_file, pool)
        values[RUN_ROW] = probe_values(estimator, pool, probe_rows(pool, blocks), label(RUN_ROW))
    return values


def weighted_pearson(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(R,) Pearson r of x and y (P,) under each row of `weights` (R, P) (bootstrap multiplicities)."""
    w = weights / weights.sum(1, keepdims=True)
    dx, dy = x - (w @ x)[:, None], y - (w @ y)[:, None]
    return (w * dx * dy).sum(1) / np.sqrt((w * dx**2).sum(1) * (w * dy**2).sum(1))


def reference(row: str) -> str | None:
    """The row a variant's row is paired with: the same preset's default row."""
    if row == RUN_ROW or row.endswith(f":{DEFAULT}"):
        return None
    return row_name(row.split(":")[0], DEFAULT)


def measure_rows(
    rewards: np.ndarray,
    values: dict[str, np.ndarray],
    grams: dict[str, torch.Tensor],
    bootstrap: int,
    seed: int,
    against: str | None = None,
) -> dict[str, Any]:
    """Per row: held-out r and, per subspace, the variance per completion and M in units of W, each with its paired
    difference against its `reference` row, and with `against` (a row) against that row too, over the same
    `bootstrap` resamples of the prompts (seed `seed`)."""
    num_prompts, k = rewards.shape
    counts = bootstrap_counts(num_prompts, bootstrap, seed)
    weights = counts / counts.sum(1, keepdims=True)
    truth = truth_weights(rewards)
    oracle, noise, signal = oracle_moments(rewards)
    success = rewards.mean(1)
    r = {row: weighted_pearson(v.reshape(num_prompts, k).mean(1), success, counts) for row, v in values.items()}
    out: dict[str, Any] = {
        "held_out_r": {row: _interval(x) for row, x in r.items()},
        "held_out_r_paired": {row: _interval(r[row] - r[ref]) for row in values if (ref := reference(row))},
    }
    others = [row for row in values if row != against] if against is not None else []
    if against is not None:
        out["held_out_r_against"] = {row: _interval(r[row] - r[against]) for row in others}
    for subspace, matrix in grams.items():
        pool = PoolGram(num_prompts, k, gram=matrix.double().numpy())
        within = weights @ pool.second(noise) - weights @ pool.second(signal)
        floor = summarize(pool, oracle, truth, counts)["variance"]
        variance = {
            row: summarize(pool, pair_moments(rewards, v.reshape(num_prompts, k)), truth, counts)["variance"]
            for row, v in values.items()
        }
        out[subspace] = {
            "oracle_variance": _interval(floor / within),
            "variance": {row: _interval(v / within) for row, v in variance.items()},
            "M": {row: _interval((v - floor) / within) for row, v in variance.items()},
            "M_paired": {
                row: _interval((variance[row] - variance[ref]) / within) for row in values if (ref := reference(row))
            },
        }
        if against is not None:
            out[subspace]["M_against"] = {
                row: _interval((variance[row] - variance[against]) / within) for row in others
            }
    return out


def _fmt(cell: dict[str, Any] | None, digits: int = 3, sign: str = "") -> str:
    if cell is None:
        return ""
    low, high = cell["ci"] or (float("nan"), float("nan"))
    return f"{cell['value']:{sign}.{digits}f} [{low:{sign}.{digits}f}, {high:{sign}.{digits}f}]"


def format_report(results: dict[str, Any]) -> str:
    pool, measured = results["pool"], results["measured"]
    against = results["settings"].get("against")
    lines = [
        f"# bench scalars: {pool['folder']}",
        "",
        f"Pool: {pool['prompts']} prompts x {pool['k']} rollouts of {pool['model']} on {pool['dataset']}, mean "
        f"reward {pool['mean_reward']:.3f}; probes fitted on {pool['probe_pool']}; 95% percentile intervals over "
        f"{results['settings']['bootstrap']} bootstrap resamples of the prompts (seed {results['settings']['seed']}), "
        "the same for every row. M = variance per completion − the oracle baseline's, in W; Δ: paired difference "
        "against the same settings' default row. Held-out r: each measured prompt's mean value against its success "
        "rate over its rollouts.",
        "",
        "Variants: " + "; ".join(f"{name}: {how}" for name, how in results["variants"].items()) + ".",
    ]
    if "probes" in results:
        probes = "; ".join(
            f"{p['label']}: {p['settings']} (probe_preset {p['probe_preset']!r}), scalars {p['scalars']}"
            for p in results["probes"].values()
        )
        lines += ["", f"Probes (each one's default row holds its own scalars): {probes}."]
    if against is not None:
        lines += ["", f"Δ vs {label(against)}: paired difference against that row over the same resamples."]
    for subspace in SUBSPACES:
        block = measured[subspace]
        rows = [
            [
                label(row),
                _fmt(block["variance"][row], 2),
                _fmt(block["M"][row], 3),
                _fmt(block["M_paired"].get(row), 3, "+"),
                _fmt(measured["held_out_r"][row], 3),
                _fmt(measured["held_out_r_paired"].get(row), 3, "+"),
                *(
                    [_fmt(block["M_against"].get(row), 3, "+"), _fmt(measured["held_out_r_against"].get(row), 3, "+")]
                    if against is not None
                    else []
                ),
            ]
            for row in block["variance"]
        ]
        headers = ["Row", "Variance (W)", "M (W)", "ΔM vs default (W)", "Held-out r", "Δr vs default"]
        headers += ["ΔM vs against (W)", "Δr vs against"] if against is not None else []
        lines += ["", f"## Subspace: {subspace}", "", format_table(headers, rows)]
        lines += ["", f"Oracle baseline's variance per completion: {_fmt(block['oracle_variance'], 2)} W."]
    if RUN_ROW in measured["held_out_r"]:
        lines += [
            "",
            "The run's saved estimator learned from earlier rollouts of the pool's prompts where they are its "
            "training prompts: its r is not held out there.",
        ]
    lines += ["", "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["seconds"].items())]
    return "\n".join(lines) + "\n"


def probes_record(probes: Sequence[str], pool: Collection) -> dict[str, Any]:
    """What each probe of a run is: its label, its settings, the preset they name (the default's, where they name
    none) and the rollout scalars of its own row."""
    configs = {name: rule_config(PROBES[name].settings, pool) for name in probes}
    return {
        name: {
            "label": PROBES[name].label,
            "settings": dict(PROBES[name].settings),
            "probe_preset": config.probe_preset,
            "scalars": list(config.probe_scalars),
        }
        for name, config in configs.items()
    }


def run_scalars(args: argparse.Namespace, log: Log = print) -> int:
    """Handler of `poise-trl bench scalars`: fit every variant's probes on the pool's probe pool and measure."""
    from poise_trl.grpo.trainer import ESTIMATOR_FILE

    start = time.perf_counter()
    folder = Path(args.folder)
    variants = [Variant(DEFAULT)] + [load_column_fn(spec) for spec in args.columns]
    variants += [load_column_fn(spec, replace=True) for spec in args.replace_scalars]
    variants += [scalar_set(spec) for spec in args.probe_scalars]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit(f"two variants share a name ({', '.join(v.name for v in variants)})")
    pool, probe, cached = read_pool(folder)
    probes = args.probes or DEFAULT_PROBES
    rows = [row_name(name, v.name) for name in probes for v in variants]
    if args.against is not None and args.against not in rows:
        raise SystemExit(f"--against {args.against}: not a row of this run; its rows: {', '.join(rows)}")
    reads_text = any(SCALARS[scalar].reads_text for name in probes for scalar in own_scalars(name, pool))
    variants = with_tokenizer(variants, args.tokenizer or pool.meta["model_path"], needed=reads_text)
    probe_prompts = args.probe_prompts or probe.num_prompts - pool.num_prompts
    keep = separate_prompts(pool, probe, probe_prompts)
    # the run's saved estimator: kept beside a committed pool, or in the snapshot's folder the pool was sampled from
    saved = [path / ESTIMATOR_FILE for path in (folder, Path(pool.meta["model_path"]))]
    values = fit_values(pool, probe, keep, variants, next((p for p in saved if p.exists()), None), log, probes)
    fitted = time.perf_counter()
    seed = int(pool.meta["seed"]) if args.seed is None else args.seed
    rewards = pool.rewards.nan_to_num(0.0).double().view(-1, pool.k).numpy()
    measured = measure_rows(rewards, values, cached["grams"], args.bootstrap, seed, args.against)
    results = {
        "pool": {
            "folder": str(folder),
            "model": pool.meta["model_name"],
            "dataset": pool.meta["dataset"],
            "prompts": pool.num_prompts,
            "k": pool.k,
            "mean_reward": float(pool.rewards.nanmean()),
            "probe_pool": f"{len(keep)} prompts x {PROBE_K} rollouts",
            # where the per-token record came from; the model's folder is the machine's, kept in the record itself
            "tokens": None if pool.tokens is None else {k: v for k, v in pool.tokens.source.items() if k != "model"},
        },
        "variants": {v.name: v.describe() for v in variants},
        # only where asked: results written before these options keep their keys
        **({"probes": probes_record(probes, pool)} if args.probes else {}),
        "settings": {"bootstrap": args.bootstrap, "seed": seed, **({"against": args.against} if args.against else {})},
        "measured": measured,
        "seconds": {"probes": fitted - start, "measure": time.perf_counter() - fitted},
    }
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    write_json(output_dir / "results.json", results)
    report = format_report(results)
    (output_dir / "results.md").write_text(report)
    log(report)
    log(f"wrote {output_dir / 'results.json'} and results.md")
    return 0
