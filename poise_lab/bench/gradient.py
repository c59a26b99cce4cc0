"""`poise-trl bench gradient`: how good each method's policy-gradient estimate is per completion, at a fixed policy.

At one policy snapshot a pool of P prompts x K rollouts is sampled and scored once, and each rollout's score-function
gradient g_i = ∇ log π(y_i | x) is taken once, in two parameter subspaces small enough to keep for every rollout:

- "lora": the gradient of rank-r LoRA B matrices (zero at init) on every linear layer. dL/dB = s · (dL/dW) Aᵀ with A
  random, so it is a fixed random sketch of the full weight gradient of every linear layer, in all decoder layers;
- "norms": the exact gradient of every RMSNorm/LayerNorm gain, a small subspace of a different kind, as the check
  that the contenders' ranking does not depend on the sketch.

Each rule's per-completion variance and bias against the true gradient of the prompt distribution are then exact
expectations over the pool (`exact`: U-statistics, no batches drawn, no reference, no centring), with percentile
bootstrap intervals over the prompts. POISE's probe is the one it would run online: fitted on a separate pool of
`--probe-prompts` prompts x 2 rollouts (the online buffer's shape), or, when the snapshot is a POISE run's output
holding its saved estimator, that estimator. With `--probe-heads`, POISE (default) again with each other value head
(`POISEConfig.probe_head`) fitted on the same separate pool, or refit on the saved estimator's own buffer, alone and
with its own probe sampler; a saved estimator with a prompt history is measured with and without it. The samples,
features and Gram matrices are cached on disk, so a rerun (another head, another floor) is the analysis alone.
"""

import argparse
import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.settings import DEFAULT_FLOOR, check_floor

from .common import config_default, format_table, other_heads, resolve_device, write_json
from .contenders import CONTENDERS
from .exact import (
    PoolGram,
    RuleMoments,
    bootstrap_counts,
    group_moments,
    oracle_moments,
    pair_moments,
    summarize,
    truth_weights,
)
from .exact import point_and_interval as _interval
from .gradient_samplers import oracle_samplers, probe_sampler, row_labels, sampled_rows
from .prefix_gradient import (
    PREFIX_COMPARATORS,
    PREFIX_LABELS,
    PREFIX_ROWS,
    SUBSPACES,
    gram,
    prefix_report,
    rollout_gradients,
    run_prefix,
)
from .value.collect import Collection, Log
from .value.resolve import collect_from_args

if TYPE_CHECKING:
    from poise_trl import POISEConfig

PROBE_K = 2  # the online buffer holds POISE's G = 2 groups
CACHE_VERSION = 1
CACHE_KEYS = (  # the arguments that decide a pool's content
    "model dataset split task reward_fn num_prompts k temperature top_p max_new_tokens layer pool_tokens "
    "reasoning_end_marker seed lora_rank probe_prompts batch_size backend device"
).split()
# shares are variance ratios against these; GRPO G=8 without std scaling is the G = 8 comparator that stays defined
# where a pool does not resolve ||g||² (its mean is exactly 7/8 of g, so its scale matching is exact)
COMPARATORS = ("grpo8", "grpo8_noscale", "rloo2")
EXTRA_ROWS = {"oracle": "Oracle baseline (true p) G=2", **row_labels()}


# ------------------------------------------------------------------------------------------- the pool, cached
def cache_dir(args: argparse.Namespace) -> Path:
    """One folder per pool: the model, prompts, sampling, features and sketch that decide its content."""
    from poise_lab.models.toy import default_cache_dir

    spec = {key: getattr(args, key, None) for key in CACHE_KEYS}
    local = Path(str(args.model))
    if local.is_dir():  # a snapshot on disk: a new save under the same path is a new pool
        spec["model_mtime"] = max(f.stat().st_mtime for f in local.iterdir())
    spec = json.dumps(spec, sort_keys=True, default=str)
    name = "".join(c if c.isalnum() else "-" for c in Path(str(args.model)).name)[:40]
    digest = hashlib.sha256(f"v{CACHE_VERSION} {spec}".encode()).hexdigest()[:12]
    return Path(args.cache_dir or default_cache_dir()) / "gradient" / f"{name}-{digest}"


def probe_pool_args(args: argparse.Namespace, collection: Collection) -> argparse.Namespace:
    """The separate pool for POISE's probe: the same model, dataset and sampling, P + probe-prompts prompts (the
    measured ones are dropped afterwards) x 2 rollouts."""
    return argparse.Namespace(
        **{
            **vars(args),
            "model": collection.meta["model_path"],
            "dataset": collection.meta["dataset"],
            "k": PROBE_K,
            "num_prompts": args.num_prompts + args.probe_prompts,
        }
    )


def _prompt_keys(collection: Collection) -> list[tuple[int, ...]]:
    return [
        tuple(ids[mask.bool()].tolist())
        for ids, mask in zip(collection.prompt_ids, collection.prompt_mask, strict=True)
    ]


def separate_prompts(pool: Collection, probe: Collection, wanted: int) -> np.ndarray:
    """The first `wanted` prompts of the probe pool that the measured pool does not hold."""
    measured = set(_prompt_keys(pool))
    keep = [p for p, key in enumerate(_prompt_keys(probe)) if key not in measured][:wanted]
    if len(keep) < wanted:
        raise SystemExit(
            f"only {len(keep)} prompts outside the measured pool for the probe's pool, not "
            f"{wanted}: lower --probe-prompts or --num-prompts"
        )
    return np.asarray(keep)


def pool_files(folder: Path) -> dict[str, Path]:
    """A cached pool's three files: the measured pool, the probe's pool and the Gram matrices."""
    return {name: folder / f"{name}.safetensors" for name in ("pool", "probe_pool", "grams")}


def read_pool(folder: Path) -> tuple[Collection, Collection, dict[str, Any]]:
    """A cached pool's measured pool, probe pool and Gram matrices ({"grams", "dimensions", "seconds", "cached"})."""
    files = pool_files(folder)
    if missing := [str(f) for f in files.values() if not f.exists()]:
        raise SystemExit(f"{folder} is not a pool of `bench gradient`: {', '.join(missing)} missing")
    tensors = load_file(str(files["grams"]))
    info = json.loads((folder / "grams.json").read_text())
    grams = {name: tensors[name] for name in SUBSPACES}
    pools = Collection.load(files["pool"]), Collection.load(files["probe_pool"])
    return *pools, {**info, "grams": grams, "cached": True}


def load_pool(args: argparse.Namespace, log: Log = print) -> tuple[Collection, Collection, dict[str, Any], Path]:
    """The measured pool, the probe's pool and the per-subspace Gram matrices ({"grams", "dimensions", "seconds"}),
    from the cache when an earlier run made them."""
    from transformers import AutoModelForCausalLM

    folder = cache_dir(args)
    files = pool_files(folder)
    if all(f.exists() for f in files.values()):
        log(f"[cache] pool, probe pool and Gram matrices from {folder}")
        return *read_pool(folder), folder
    seconds: dict[str, float] = {}
    collection = collect_from_args(args, log)
    seconds.update({k: float(v) for k, v in collection.meta["seconds"].items()})
    collection.save(files["pool"])
    log(f"      the probe's separate pool: {args.probe_prompts} prompts x {PROBE_K} rollouts")
    t = time.perf_counter()
    probe = collect_from_args(probe_pool_args(args, collection), log)
    probe.save(files["probe_pool"])
    seconds["probe_pool"] = time.perf_counter() - t
    model = AutoModelForCausalLM.from_pretrained(collection.meta["model_path"], dtype=torch.float32)
    model.to(resolve_device(args.device))
    log(f"[3/4] per-rollout gradients of {collection.rewards.numel()} rollouts (LoRA r={args.lora_rank} and norms)")
    t = time.perf_counter()
    gradients = rollout_gradients(model, collection, args.lora_rank, args.seed, log)
    grams = {name: gram(g) for name, g in gradients.items()}
    seconds["gradients"] = time.perf_counter() - t
    info = {"dimensions": {name: int(g.size(1)) for name, g in gradients.items()}, "seconds": seconds}
    save_file({name: g.contiguous() for name, g in grams.items()}, str(files["grams"]))
    (folder / "grams.json").write_text(json.dumps(info))
    return collection, probe, {**info, "grams": grams, "cached": False}, folder


# --------------------------------------------------------------------------------------------- POISE's probes
def head_row(head: str, history: bool = True) -> str:
    """The row of POISE (default) with value head `head` (`--probe-heads`); `history=False`: refit without the
    prompt history a run's saved estimator holds."""
    return f"poise_head_{head}" + ("" if history else "_nohistory")


Rule = str | Mapping[str, Any]
"""A contender's name (a key of `CONTENDERS`), or the `POISEConfig` fields of a probe to fit (`bench scalars`'
`--probes`)."""


def rule_config(rule: Rule, collection: Collection, head: str | None = None, history: bool = False) -> "POISEConfig":
    """The config `rule`'s probe is built from (with `head`, that value head; with `history`, the prompt history) at
    the pool's default capture."""
    from poise_trl import POISEConfig

    meta = collection.meta
    overrides = CONTENDERS[rule].overrides if isinstance(rule, str) else rule
    settings = {**overrides, **({"probe_head": head} if head else {})}
    settings.update(probe_history=history, probe_layer=int(meta["default_layer"]), num_generations=PROBE_K)
    return POISEConfig(output_dir="unused", report_to="none", use_cpu=True, **settings)


def new_estimator(
    rule: Rule, collection: Collection, head: str | None = None, history: bool = False
) -> tuple[POISEEstimator, list[str]]:
    """An empty estimator with `rule`'s settings (`rule_config`), built as the trainer builds it
    (`POISEEstimator.from_config`), and the feature blocks its probe reads."""
    config = rule_config(rule, collection, head, history)
    meta = collection.meta
    estimator = POISEEstimator.from_config(config, int(meta["num_layers"]), int(meta["hidden_size"]))
    return estimator, list(config.probe_features)


Rows = Callable[[Collection, Sequence[str]], torch.Tensor]


def probe_rows(collection: Collection, blocks: Sequence[str]) -> torch.Tensor:
    """(N, D) the probe's input rows: `blocks` at the pool's default capture (layer, pooling window)."""
    return collection.columns(blocks, int(collection.meta["default_layer"]), int(collection.meta["default_pool"]))


def fitted_probe(
    rule: Rule,
    collection: Collection,
    probe: Collection,
    keep: np.ndarray,
    head: str | None = None,
    rows: Rows = probe_rows,
) -> tuple[POISEEstimator, list[str]]:
    """`rule`'s estimator after observing the probe pool's prompts `keep` in pairs, over its warm-up steps plus a
    few, as it would online (with `head`, that value head instead of the rule's own; with `rows`, other input rows
    of the feature blocks its probe reads); and those blocks."""
    estimator, blocks = new_estimator(rule, collection, head)
    features = rows(probe, blocks)
    for chunk in np.array_split(keep, estimator.spec.buffer.warmup_steps + 4):
        picked = torch.from_numpy((chunk[:, None] * PROBE_K + np.arange(PROBE_K)).ravel())
        estimator.observe(features=features[picked], rollouts=Rollouts(probe.rewards[picked].nan_to_num(0.0)))
    return estimator, blocks


def run_estimator(
    path: Path, collection: Collection, head: str | None = None, history: bool | None = None
) -> tuple[POISEEstimator, list[str]]:
    """The run's saved estimator (the file `POISETrainer.save_probe` wrote), as saved or refit (`POISEEstimator.refit`)
    with `head` and, with `history=False` where the run kept a prompt history, without it: each head and input set
    on exactly the rows the run's own probe learned from."""
    from poise_trl.estimator.files import read_state

    saved_history = "history" in read_state(path)["info"]
    estimator, blocks = new_estimator("poise", collection, history=saved_history)
    estimator.load(path)
    history = saved_history if history is None else history
    if history and not saved_history:
        raise ValueError(f"{path} holds no prompt history (the run set probe_history=False)")
    saved_head = next(iter(estimator.probes_.values())).probe.name
    if (head or saved_head, history) == (saved_head, saved_history):
        return estimator, blocks
    spec = estimator.spec
    spec = replace(spec, head=replace(spec.head, name=head or saved_head), history=spec.history if history else None)
    return estimator.refit(spec), blocks


def row_prompt_keys(collection: Collection) -> torch.Tensor:
    """(N,) each rollout's prompt id, as the trainer keys its prompt history (`buffer.prompt_group_ids`)."""
    keys = collection.meta.get("prompt_keys")
    if keys is None:
        raise SystemExit(
            "this pool was sampled before pools kept their prompts' ids, which a run's prompt history is read by: "
            "delete its cache folder (or pass another --cache-dir) to sample it again"
        )
    return torch.tensor(keys, dtype=torch.long)[collection.prompt_index]


def online_values(
    collection: Collection,
    probe: Collection,
    keep: np.ndarray,
    floor: float = DEFAULT_FLOOR,
    log: Log = print,
    heads: Sequence[str] = (),
) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, np.ndarray]]:
    """Each measured rollout's probe value for POISE (paper), POISE (default) and POISE (default) with each of
    `heads` (rows `head_row(head)`), where each probe came from, and the probe sampler of POISE (default) and of
    each head row over the pool's prompts ({row: q}, `gradient_samplers.probe_sampler`, at `floor`).

    When the model folder holds the run's saved estimator (the file `POISETrainer.save_probe` writes), POISE
    (default) is that estimator and each head row the same refit with that head (`run_estimator`); if the run kept
    a prompt history, every head (the default included) is measured again without it (`head_row(head, history=False)`).
    Otherwise every probe is `fitted_probe` on the separate pool."""
    from poise_trl.grpo.trainer import ESTIMATOR_FILE

    layer, pool = int(collection.meta["default_layer"]), int(collection.meta["default_pool"])
    saved = Path(collection.meta["model_path"]) / ESTIMATOR_FILE
    separate = f"fitted on a separate pool of {len(keep)} prompts x {PROBE_K} rollouts"
    values, sources, samplers = {}, {}, {}
    fits: list[tuple[str, Any]] = [("poise_paper", lambda: fitted_probe("poise_paper", collection, probe, keep))]
    if saved.exists():
        run = run_estimator(saved, collection)
        with_history = run[0].prompt_history_ is not None
        fits.append(("poise", lambda: run))
        sources["poise"] = f"the run's saved estimator ({ESTIMATOR_FILE})"
        default = config_default("probe_head")  # POISE (default)'s head: the "poise" row
        for head in [default, *heads] if with_history else heads:
            for history in (True, False) if with_history else (None,):  # None: as the run kept it (none)
                row = head_row(head, history is not False)
                if row == head_row(default):
                    continue  # the run's own estimator when it has the default head and history: the "poise" row
                fits.append((row, lambda h=head, hist=history: run_estimator(saved, collection, h, hist)))
                sources[row] = f"the run's saved estimator refit with the {head} head on its own buffer" + (
                    ", without the prompt history" if history is False else ""
                )
    else:
        fits.append(("poise", lambda: fitted_probe("poise", collection, probe, keep)))
        fits += [(head_row(h), lambda h=h: fitted_probe("poise", collection, probe, keep, h)) for h in heads]
    for row, fit in fits:
        estimator, blocks = fit()
        sources.setdefault(row, separate)
        keys = row_prompt_keys(collection) if estimator.prompt_history_ is not None else None
        values[row] = probe_values(estimator, collection, collection.columns(blocks, layer, pool), label(row))
        if row != "poise_paper":
            samplers[row] = probe_sampler(estimator, collection, layer, pool, floor, keys)
        log(f"      {label(row)}: probe {sources[row]}")
    return values, sources, samplers


def probe_values(estimator: POISEEstimator, collection: Collection, features: torch.Tensor, name: str) -> np.ndarray:
    """(N,) each measured rollout's value from a trusted probe (its prompt's history by the trainer's ids where the
    estimator keeps one), every one finite."""
    if not estimator.trusted_:
        raise RuntimeError(f"{name}: the probe is not trusted; give more --probe-prompts")
    keys = row_prompt_keys(collection) if estimator.prompt_history_ is not None else None
    record = Rollouts(collection.rewards.nan_to_num(0.0), prompt_ids=keys)
    out = estimator.predict(features, record).double().numpy()
    if not np.isfinite(out).all():
        raise RuntimeError(f"{name}: the probe gave non-finite values for {int((~np.isfinite(out)).sum())} rows")
    return out


# --------------------------------------------------------------------------------------------------- measuring
def rule_moments(
    rewards: np.ndarray, values: dict[str, np.ndarray], rules: list[str], probe: bool = True
) -> dict[str, RuleMoments]:
    """Every contender's moments, the oracle baseline's, and POISE (default)'s and GRPO G=8's again for the oracle
    sampler and (with `probe`) the probe sampler."""
    out: dict[str, RuleMoments] = {}
    for rule in rules:
        contender = CONTENDERS[rule]
        if contender.gradient in ("group", "informative_groups"):
            scale = contender.overrides.get("scale_rewards") != "none"
            informative = contender.gradient == "informative_groups"
            out[rule] = group_moments(rewards, contender.group_size, scale, informative_only=informative)
        elif contender.gradient == "leave_one_out":
            out[rule] = pair_moments(rewards, rewards)
        elif contender.gradient == "probe":
            out[rule] = pair_moments(rewards, values[rule].reshape(rewards.shape))
        else:
            raise ValueError(f"{rule}: bench gradient measures no {contender.gradient!r} rule in one pass")
    out["oracle"] = oracle_moments(rewards)[0]
    out.update({row: out[rule] for row, rule in sampled_rows(rules, oracle=True, probe=probe).items()})
    return out


def measure(
    rewards: np.ndarray,
    values: dict[str, np.ndarray],
    grams: dict[str, torch.Tensor],
    rules: list[str],
    bootstrap: int,
    seed: int,
    prompt_samplers: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Per subspace and rule: per-completion variance and scale-matched variance in units of the within-prompt
    noise W, bias² relative to ||g||², the scale-matched variance's share against GRPO-8 and RLOO-2; and ||g||²/W
    and Bv/W. Point estimates with 95% percentile intervals over `bootstrap` resamples of the prompts (the same
    resamples for every rule). `prompt_samplers` {row: (P,) q} are the probe samplers over the prompts: POISE
    (default)'s (`"poise"`: its and GRPO G=8's probe-sampler rows) and each head row's (None: no probe-sampler
    rows). The head rows (`head_row`) are POISE (default) with `values[row]` as its values."""
    prompt_samplers = dict(prompt_samplers or {})
    prompt_sampler = prompt_samplers.pop("poise", None)
    num_prompts, k = rewards.shape
    if not (rewards.max(1) > rewards.min(1)).any():
        raise ValueError(
            "no prompt of the pool has mixed rewards, so there is no policy gradient to estimate: use more prompts, "
            "more rollouts per prompt, or a task the model solves sometimes"
        )
    counts = bootstrap_counts(num_prompts, bootstrap, seed)
    truth = truth_weights(rewards)
    moments = rule_moments(rewards, values, rules, probe=prompt_sampler is not None)
    samplers = oracle_samplers(rewards, values.get("poise"), rules)
    probed = sampled_rows(rules, oracle=False, probe=prompt_sampler is not None)
    samplers.update({row: prompt_sampler for row in probed})
    for row, q in prompt_samplers.items():  # the head rows, alone and with their own probe sampler
        moments[row] = pair_moments(rewards, values[row].reshape(rewards.shape))
        moments[f"{row}_probe_sampler"] = moments[row]
        samplers[f"{row}_probe_sampler"] = q
    _, noise, signal = oracle_moments(rewards)
    out: dict[str, Any] = {}
    for subspace, matrix in grams.items():
        pool = PoolGram(num_prompts, k, gram=matrix.double().numpy())
        weights = counts / counts.sum(1, keepdims=True)
        stats = {rule: summarize(pool, m, truth, counts, samplers.get(rule)) for rule, m in moments.items()}
        gg = stats["oracle"]["signal"]
        matched = {rule: s["variance"] * (gg / s["mean_dot"]) ** 2 for rule, s in stats.items()}
        within = weights @ pool.second(noise) - weights @ pool.second(signal)
        between = weights @ pool.second(signal) - gg
        table = {}
        for rule, s in stats.items():
            cell = {
                "variance": _interval(s["variance"] / within),
                "bias2": _interval(s["bias2"] / gg),
                "matched_variance": _interval(matched[rule] / within),
            }
            for comparator in COMPARATORS:
                if comparator in matched:
                    cell[f"share_{comparator}"] = _interval(matched[rule] / matched[comparator])
            table[rule] = cell
        out[subspace] = {
            "table": table,
            "paired": {
                f"{a} - {b}": _interval((stats[a]["variance"] - stats[b]["variance"]) / within)
                for a, b in paired_rows(list(stats))
            },
            "signal": float(gg[0]),
            "within_noise": float(within[0]),
            "signal_over_within": _interval(gg / within),
            "between_over_within": _interval(between / within),
        }
    return out


def paired_rows(rows: list[str]) -> list[tuple[str, str]]:
    """The (row, reference) pairs whose variance difference is reported over the same bootstrap resamples, which
    resolve it far more sharply than two separate intervals: each other head against POISE (default)'s, with
    the same inputs, and each head with the prompt history against itself without it (a run that kept one)."""

    default = config_default("probe_head")

    def reference(history: bool) -> str:
        return "poise" if history else head_row(default, history=False)

    pairs = []
    for row in rows:
        if not row.startswith("poise_head_") or row.endswith("_sampler"):
            continue
        history = not row.endswith("_nohistory")
        if row != reference(history) and reference(history) in rows:
            pairs.append((row, reference(history)))
        if history and (without := f"{row}_nohistory") in rows:
            pairs.append((row, without))
    if "poise" in rows and (without := head_row(default, history=False)) in rows:
        pairs.append(("poise", without))
    return pairs


def ranking_agreement(results: dict[str, Any]) -> float:
    """Kendall's tau between the two subspaces' orderings of the rules by scale-matched variance."""
    from scipy.stats import kendalltau

    a, b = (results[s]["table"] for s in SUBSPACES)
    return float(
        kendalltau([a[r]["matched_variance"]["value"] for r in a], [b[r]["matched_variance"]["value"] for r in a])[0]
    )


# ---------------------------------------------------------------------------------------------------- report
def label(rule: str) -> str:
    if rule.startswith("poise_head_"):
        head, sampled = rule.removeprefix("poise_head_").removesuffix("_probe_sampler"), rule.endswith("_sampler")
        head = head.replace("_nohistory", ", no history")
        return f"POISE (default) [{head}]" + (" + probe sampler" if sampled else "") + " G=2"
    return EXTRA_ROWS.get(rule) or PREFIX_LABELS.get(rule) or CONTENDERS[rule].label


def _fmt(cell: dict[str, Any] | None, digits: int = 3) -> str:
    if cell is None:
        return ""
    ci = cell["ci"]
    return f"{cell['value']:.{digits}f}" + ("" if not ci else f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]")


def unstable_rules(table: dict[str, Any]) -> list[str]:
    """The rules whose scale-matched variance's point estimate lies outside its own bootstrap interval."""
    return [
        rule
        for rule, cell in table.items()
        if (ci := cell["matched_variance"]["ci"]) and not ci[0] <= cell["matched_variance"]["value"] <= ci[1]
    ]


def format_report(results: dict[str, Any]) -> str:
    pool, s = results["pool"], results["settings"]
    lines = [
        f"# bench gradient: {pool['model_name']} on {pool['dataset']}",
        "",
        f"Pool: {pool['prompts']} prompts x {pool['k']} rollouts, mean reward {pool['mean_reward']:.3f}, "
        f"{pool['mixed_share']:.0%} of prompts with mixed outcomes. Exact expectations over the pool (U-statistics: "
        "a batch of n prompts drawn with replacement, G rollouts per prompt, for every n); 95% percentile intervals "
        f"over {s['bootstrap']} bootstrap resamples of the prompts.",
        "",
        "POISE's probes: " + "; ".join(f"{label(r)}: {src}" for r, src in results["probes"].items()) + ".",
        "",
        "Columns: the per-completion variance B·tr Cov(ĝ), in units of W = E tr Cov((r − p) ∇log π | x), the within-"
        "prompt noise that no sequence-level baseline removes (a G = 2 rule with the true success rate p as baseline "
        "pays W + 2 Bv); bias² = ||E ĝ − g||² relative to ||g||² (g the true gradient); the scale-matched variance, "
        "of ĝ·||g||²/(E ĝ·g), what a tuned learning rate sees (equal to the variance for unbiased rules, fair to "
        "rules that rescale); shares are ratios of scale-matched variances: the completions a rule needs, as a share "
        "of GRPO G=8's (with and without std scaling) and RLOO k=2's, for the same error. DAPO-DS-carry keeps a fixed"
        " number of informative groups and is charged its expected G/q completions per kept group. The oracle sampler"
        " draws prompts with probability ∝ sqrt(E[(r − b)² | x]) read off the pool, weighted 1/(n q); the probe "
        "sampler draws them as prompt_selection='importance' does online, from POISE (default)'s prompt-only probe "
        "before generating (q ∝ sqrt(v(1 − v)) mixed with uniform at the floor "
        f"{s['prompt_selection_floor']}), weighted 1/(n q).",
    ]
    for subspace in SUBSPACES:
        block = results["subspaces"][subspace]
        lines += ["", f"## Subspace: {subspace} ({results['dimensions'][subspace]} dimensions)", ""]
        rows = [
            [
                label(rule),
                _fmt(c["variance"], 2),
                _fmt(c["bias2"]),
                _fmt(c["matched_variance"], 2),
                *(_fmt(c.get(f"share_{comparator}"), 2) for comparator in COMPARATORS),
            ]
            for rule, c in block["table"].items()
        ]
        headers = [
            "Rule",
            "Variance per completion (W)",
            "Bias² (||g||²)",
            "Scale-matched variance (W)",
            *(f"Share of {CONTENDERS[comparator].label}" for comparator in COMPARATORS),
        ]
        lines.append(format_table(headers, rows))
        lines += [
            "",
            f"Between-prompt over within-prompt variance Bv/W: {_fmt(block['between_over_within'], 4)}. Signal "
            f"||g||²/W: {_fmt(block['signal_over_within'], 5)} (an unbiased rule needs its variance / ||g||² "
            "completions for a relative MSE of 1).",
        ]
        if paired := block.get("paired"):
            pairs = [(key.split(" - "), cell) for key, cell in paired.items()]
            lines += [
                "",
                "Paired differences of the per-completion variance (W), over the same bootstrap resamples: "
                + "; ".join(f"{label(a)} − {label(b)}: {_fmt(cell, 2)}" for (a, b), cell in pairs)
                + ".",
            ]
        if unstable := unstable_rules(block["table"]):
            lines += [
                "",
                f"**Scale matching is unstable on this pool** for {', '.join(map(label, unstable))}: the point "
                "estimate of the scale-matched variance lies outside its own bootstrap interval, because it divides "
                "by estimates of ||g||² and E ĝ·g that the pool does not resolve (see ||g||²/W). Those rows' "
                "scale-matched variances, and every share taken against them, are not meaningful here; compare "
                "unbiased rules by their variance per completion (the share of RLOO k=2 is a ratio of two unbiased "
                "rules' variances).",
            ]
    lines += prefix_report(results, _fmt)
    lines += ["", f"Ranking agreement between subspaces (Kendall's tau): {results['ranking_agreement']:+.2f}"]
    cached = " (the pool's from its first run; this run read it from the cache)" if results["cached"] else ""
    lines += ["", "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in results["seconds"].items()) + cached]
    return "\n".join(lines) + "\n"


def plot_shares(results: dict[str, Any], path: Path) -> Path:
    """Each rule's completions as a share of GRPO G=8's for the same error, with its interval, one panel per
    subspace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SUBSPACES), figsize=(11, 4.2), sharey=True, layout="constrained")
    for ax, subspace in zip(axes, SUBSPACES, strict=True):
        table = results["subspaces"][subspace]["table"]
        rules = [r for r in table if "share_grpo8" in table[r]]
        shares = [table[r]["share_grpo8"] for r in rules]
        # a percentile interval of a skewed ratio may miss its point estimate: the bar then stops at the point
        low = [max(c["value"] - c["ci"][0], 0) if c["ci"] else 0 for c in shares]
        high = [max(c["ci"][1] - c["value"], 0) if c["ci"] else 0 for c in shares]
        ax.barh([label(r) for r in rules], [c["value"] for c in shares], xerr=[low, high], color="tab:blue", alpha=0.7)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set(xscale="log", title=subspace)
        ax.grid(alpha=0.3, axis="x", which="both")
    fig.supxlabel("completions as a share of GRPO G=8's (scale-matched variance ratio)")  # one label: two overlap
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_gradient(args: argparse.Namespace, log: Log = print) -> int:
    """Handler of `poise-trl bench gradient`: sample the pools, take per-rollout gradients (or read them from the
    cache), fit the probes, and measure."""
    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    contenders = [r for r in args.contenders if r not in PREFIX_ROWS]
    largest = max((CONTENDERS[r].group_size for r in contenders), default=2)
    if args.k < max(largest, 3):
        raise SystemExit(
            f"--k {args.k}: the pool needs at least {max(largest, 3)} rollouts per prompt (G={largest} "
            "and the oracle baseline's 3)"
        )
    check_floor(args.prompt_selection_floor)  # before the pool is sampled, not after
    heads = other_heads(args.probe_heads)  # the default head is POISE (default)'s own row
    if args.probe_prompts < 1:
        raise SystemExit(f"--probe-prompts {args.probe_prompts}: the probe needs a pool of its own")
    collection, probe, pool, folder = load_pool(args, log)
    seconds = dict(pool["seconds"])
    t = time.perf_counter()
    keep = separate_prompts(collection, probe, args.probe_prompts)
    values, sources, samplers = online_values(collection, probe, keep, args.prompt_selection_floor, log, heads)
    seconds["probes"] = time.perf_counter() - t
    log(f"[4/4] exact moments of {len(args.contenders)} rules, {args.bootstrap} bootstrap resamples")
    t = time.perf_counter()
    rewards = collection.rewards.nan_to_num(0.0).double().view(-1, collection.k).numpy()
    measured = measure(rewards, values, pool["grams"], contenders, args.bootstrap, args.seed, samplers)
    seconds["measure"] = time.perf_counter() - t
    comparators = rule_moments(rewards, values, [c for c in PREFIX_COMPARATORS if c in contenders], probe=False)
    prefix = run_prefix(
        args, collection, probe, keep, folder, rewards, values, comparators, measured, samplers["poise"], log
    )
    seconds.update(prefix.pop("seconds", {}))
    seconds["total"] = time.perf_counter() - start
    by_prompt = collection.rewards.view(-1, collection.k)
    results = {
        "pool": {
            "model_name": args.model,
            "dataset": collection.meta["dataset"],
            "prompts": collection.num_prompts,
            "k": collection.k,
            "mean_reward": float(collection.rewards.nanmean()),
            "mixed_share": float((by_prompt.amax(1) > by_prompt.amin(1)).float().mean()),
            "mean_completion_tokens": collection.meta["mean_completion_tokens"],
            "probe_pool": f"{args.probe_prompts} prompts x {PROBE_K} rollouts",
        },
        "probes": sources,
        "settings": {
            key: getattr(args, key)
            for key in (
                "bootstrap",
                "lora_rank",
                "seed",
                "contenders",
                "probe_prompts",
                "prompt_selection_floor",
                "probe_heads",
            )
        },
        "dimensions": pool["dimensions"],
        "subspaces": measured,
        "prefix": prefix,
        "ranking_agreement": ranking_agreement(measured),
        "seconds": seconds,
        "cached": pool["cached"],
    }
    write_json(output_dir / "results.json", results)
    report = format_report(results)
    (output_dir / "results.md").write_text(report)
    plot_shares(results, output_dir / "gradient.png")
    log(report)
    log(f"wrote {output_dir / 'results.json'}, results.md and gradient.png (pool cached in {folder})")
    return 0
