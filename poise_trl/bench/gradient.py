"""`poise-trl bench gradient`: how good each method's policy-gradient estimate is per completion, at a fixed policy.

At one policy snapshot a pool of P prompts x M rollouts is sampled and scored once, and each rollout's score-function
gradient g_i = ∇ log π(y_i | x) is taken once, in two parameter subspaces small enough to keep for every rollout:

- "lora": the gradient of rank-r LoRA B matrices (zero at init) on every linear layer. dL/dB = s · (dL/dW) Aᵀ with A
  random, so it is a fixed random sketch of the full weight gradient of every linear layer, in all decoder layers;
- "norms": the exact gradient of every RMSNorm/LayerNorm gain, a small subspace of a different kind, as the check
  that the contenders' ranking does not depend on the sketch.

Every contender's batch gradient is a weighted sum ĝ = Σ_i w_i g_i of the stored gradients (w_i = A_i / completions
used), so its error against the reference depends on the gradients only through their Gram matrix K = G Gᵀ and
thousands of batches cost a few matrix gathers. The reference is the unbiased leave-one-out estimate from every
rollout of every prompt, g_ref = mean over prompts and rollouts of (r_i - mean of the prompt's other rewards) g_i;
RLOO drawn from the pool is unbiased for it exactly. The gradients are centred within each prompt before the Gram
matrix (the true score has mean zero; a pool's does not, which would charge a probe's baseline with a bias that is
the pool's, see `gram`). Batch prompts are drawn with replacement (the prompt-level variance is the same at every
budget) and a group's rollouts without replacement from the prompt's M, which scales within-prompt variance by about
(M - G) / (M - 1): 0.53 for G = 8 of M = 16, 0.77 of 32, 0.93 and 0.97 for G = 2; this favours G = 8 (run a larger
--k to shrink it).

POISE's probe for a prompt is fitted on rollouts of the pool's other prompts, in pairs as its online buffer would
hold them (K-fold by prompt, `POISEEstimator.observe`), never on the batch's own rows; the G = 2 baseline of rollout
i is its partner's value, as `POISEEstimator.advantages` gives it.
"""

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poise_trl.baselines import leave_one_out_targets
from poise_trl.estimator import POISEEstimator

from .common import CONTENDERS, format_table, resolve_device, write_json
from .common import GRADIENT_REFERENCE_BUDGET as REFERENCE_BUDGET
from .value.collect import Collection, Log
from .value.resolve import collect_from_args

SUBSPACES = ("lora", "norms")
GOALS = {"rloo2": 0.6, "dapo_ds_carry": 0.5}  # issue 23: POISE's completions as a share of the comparator's
STD_EPS = 1e-4  # TRL's GRPO: (r - mean) / (std + 1e-4)


# ----------------------------------------------------------------------------------------- per-rollout gradients
def rollout_gradients(
    model: Any, collection: Collection, lora_rank: int = 1, seed: int = 0, log: Log = print
) -> dict[str, torch.Tensor]:
    """(N, D_s) float32 gradients of each rollout's sequence log-probability, one matrix per subspace (`SUBSPACES`).

    The policy is the sampling policy: logits divided by the collection's temperature, as TRL scores completions."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # LoRA's A (the sketch) is random; B starts at zero so the policy is unchanged
    config = LoraConfig(r=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0, target_modules="all-linear")
    peft_model = get_peft_model(model, config)
    lora_b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    norms = [p for n, p in peft_model.named_parameters() if "norm" in n.lower() and "lora_" not in n]
    if not norms:
        raise ValueError("the model has no parameter named '*norm*': the second subspace needs its norm gains")
    kept = {id(p) for p in lora_b + norms}
    for param in peft_model.parameters():
        param.requires_grad_(id(param) in kept)
    temperature = float(collection.meta.get("temperature", 1.0))
    device = next(peft_model.parameters()).device
    peft_model.eval()  # no dropout: the gradient of the policy that sampled
    out = {name: [] for name in SUBSPACES}
    start = time.perf_counter()
    for i in range(collection.rewards.numel()):
        p = int(collection.prompt_index[i])
        prompt = collection.prompt_ids[p][collection.prompt_mask[p].bool()]
        completion = collection.completion_ids[i][collection.completion_mask[i].bool()].long()
        ids = torch.cat([prompt, completion]).to(device)[None]
        logits = peft_model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float() / temperature
        log_prob = torch.log_softmax(logits, -1).gather(1, completion.to(device)[:, None]).sum()
        grads = torch.autograd.grad(log_prob, lora_b + norms)
        out["lora"].append(torch.cat([g.flatten() for g in grads[: len(lora_b)]]).float().cpu())
        out["norms"].append(torch.cat([g.flatten() for g in grads[len(lora_b) :]]).float().cpu())
        if (i + 1) % 256 == 0:
            log(f"      gradients of {i + 1} rollouts: {time.perf_counter() - start:.0f}s")
    peft_model.unload()
    return {name: torch.stack(rows) for name, rows in out.items()}


def gram(gradients: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """K = G Gᵀ in float64 (the errors subtract nearly equal quadratic forms), of gradients centred within each
    prompt's k rollouts when `k` is given.

    The true score has mean zero under the policy, E[∇ log π(y|x)] = 0, but a pool of 16 rollouts has a non-zero
    mean score ḡ_x. Taken as the population, it would charge a baseline b that is not a function of the pool's own
    rewards (a probe's value) with a bias (r̄_x − b_x) ḡ_x that no budget shrinks, a property of the pool, not of
    the rule. Centring restores the identity; it leaves every rule whose advantages sum to zero within a group
    (GRPO, DAPO, RLOO, the reference) exactly as it was."""
    g = gradients.double()  # a copy: centred in place
    if k is not None:
        grouped = g.view(-1, k, g.size(1))
        grouped -= grouped.mean(1, keepdim=True)
    return g @ g.T


# -------------------------------------------------------------------------------------------------- the rules
def loo_advantages(rewards: torch.Tensor, k: int) -> torch.Tensor:
    """r_i minus the mean reward of the prompt's other k - 1 rollouts (the reference's advantage)."""
    return rewards - leave_one_out_targets(rewards, k)


def reference_weights(rewards: torch.Tensor, k: int, prompt_counts: np.ndarray | None = None) -> np.ndarray:
    """w_ref with g_ref = Σ w_ref_i g_i: the mean over prompts (weighted by `prompt_counts` in a bootstrap
    resample) of the mean over their rollouts of A_i^LOO g_i."""
    num_prompts = rewards.numel() // k
    counts = np.ones(num_prompts) if prompt_counts is None else prompt_counts
    a = loo_advantages(rewards, k).double().numpy()
    return a * np.repeat(counts, k) / (k * counts.sum())


@dataclass(frozen=True)
class Batches:
    """`num` batches of one contender at one budget: row indices (num, n) into the pool and their weights."""

    index: np.ndarray
    weight: np.ndarray


def draw_batches(
    rule: str,
    budget: int,
    rewards: np.ndarray,
    k: int,
    prompt_pool: np.ndarray,
    num: int,
    rng: np.random.Generator,
    values: dict[str, np.ndarray] | None = None,
) -> Batches:
    """Batches of `budget` completions generated: budget / G prompts drawn from `prompt_pool` with replacement, G of
    each prompt's k rollouts without replacement, and each rule's weight A_i / (completions in its loss)."""
    group = CONTENDERS[rule].group_size
    if budget % group or group > k:
        raise ValueError(f"{rule}: budget {budget} must hold whole groups of {group}, and G={group} <= k={k}")
    prompts = prompt_pool[rng.integers(len(prompt_pool), size=(num, budget // group))]
    choice = np.argsort(rng.random((num, budget // group, k)), axis=-1)[..., :group]
    index = prompts[..., None] * k + choice
    r = rewards[index]
    mean = r.mean(-1, keepdims=True)
    if rule in ("grpo8", "grpo8_noscale", "dapo_ds_carry"):
        advantage = r - mean
        if rule != "grpo8_noscale":
            advantage = advantage / (r.std(-1, ddof=1, keepdims=True) + STD_EPS)
        used = np.full((num, 1, 1), float(budget))
        if rule == "dapo_ds_carry":  # every informative group generated enters a loss (the surplus carried over)
            informative = (r.max(-1, keepdims=True) > r.min(-1, keepdims=True)).astype(float)
            advantage = advantage * informative
            used = informative.sum((1, 2), keepdims=True) * group
        weight = np.divide(advantage, used, out=np.zeros_like(advantage), where=used > 0)
    elif rule == "rloo2":
        weight = (r - (r.sum(-1, keepdims=True) - r) / (group - 1)) / budget
    else:  # POISE, G = 2: the baseline of rollout i is its partner's probe value
        v = values[rule][index]
        weight = (r - v[..., ::-1]) / budget
    return Batches(index.reshape(num, -1), weight.reshape(num, -1))


def batch_errors(batches: Batches, k_matrix: torch.Tensor, w_ref: np.ndarray) -> dict[str, float]:
    """The batches' relative MSE against g_ref (||ĝ - g_ref||² / ||g_ref||²), its bias² part, mean cosine, and the
    relative MSE at the best constant scale c ĝ (1 - E[ĝ·g]² / (E||ĝ||² ||g||²)): what a tuned learning rate leaves,
    equal in ranking to the plain MSE between unbiased rules and fair to rules that rescale (std scaling)."""
    ref = torch.from_numpy(w_ref)
    u = k_matrix @ ref
    ref_norm = float(ref @ u)
    if ref_norm <= 0:  # no prompt with mixed rewards: there is no gradient to estimate
        return dict.fromkeys(("relative_mse", "bias", "cosine", "best_scale_mse"), math.nan)
    index, weight = torch.from_numpy(batches.index), torch.from_numpy(batches.weight)
    quad = torch.empty(index.size(0), dtype=torch.float64)
    for s in range(0, index.size(0), 64):
        i, w = index[s : s + 64], weight[s : s + 64]
        quad[s : s + 64] = torch.einsum("bi,bij,bj->b", w, k_matrix[i[:, :, None], i[:, None, :]], w)
    cross = (weight * u[index]).sum(1)
    cosine = torch.where(quad > 0, cross / (quad.clamp(min=1e-300) * ref_norm).sqrt(), 0.0)
    mean_w = torch.zeros_like(ref).index_add_(0, index.flatten(), weight.flatten()) / index.size(0)
    return {
        "relative_mse": float((quad - 2 * cross + ref_norm).mean()) / ref_norm,
        "bias": float((mean_w - ref) @ k_matrix @ (mean_w - ref)) / ref_norm,
        "cosine": float(cosine.mean()),
        "best_scale_mse": 1 - float(cross.mean()) ** 2 / max(float(quad.mean()) * ref_norm, 1e-300),
    }


def bias_corrected_interval(point: float, replicates: np.ndarray, level: float = 0.95) -> list[float]:
    """Efron's bias-corrected percentile interval: a resample with repeated prompts has a larger reference norm, so
    its errors sit systematically below the point estimate and a plain percentile interval can miss it."""
    from scipy.stats import norm

    replicates = replicates[np.isfinite(replicates)]
    if not len(replicates):
        return [math.nan, math.nan]
    below = np.clip((replicates < point).mean() + 0.5 * (replicates == point).mean(), 0.5 / len(replicates),
                    1 - 0.5 / len(replicates))  # fmt: skip
    z0, z = norm.ppf(below), norm.ppf(0.5 + level / 2)
    return np.quantile(replicates, norm.cdf([2 * z0 - z, 2 * z0 + z])).tolist()


# --------------------------------------------------------------------------------------------- POISE's probes
def cross_fitted_values(
    collection: Collection, folds: int = 4, seed: int = 0, log: Log = print
) -> dict[str, np.ndarray]:
    """Each rollout's probe value for POISE (paper) and POISE (default), from an estimator that observed only the
    other folds' prompts, their rollouts paired as G = 2 steps, until trusted (warm-up steps plus a few)."""
    from poise_trl import POISEConfig

    layer, pool, k = int(collection.meta["default_layer"]), int(collection.meta["default_pool"]), collection.k
    fold_of = np.random.default_rng(seed).permutation(collection.num_prompts) % folds
    rewards = collection.rewards
    values: dict[str, np.ndarray] = {}
    for rule in ("poise_paper", "poise"):
        overrides = {**CONTENDERS[rule].overrides, **CONTENDERS[rule].pins}
        config = POISEConfig(output_dir="unused", report_to="none", use_cpu=True, **overrides)
        features = collection.columns(config.probe_features, layer, pool)
        settings = config.estimator_settings(int(collection.meta["num_layers"]), int(collection.meta["hidden_size"]))
        settings.update(layers=[layer], layer_index=0)
        out = np.full(rewards.numel(), np.nan)
        for fold in range(folds):
            estimator = POISEEstimator(2, **settings)
            train = np.flatnonzero(fold_of != fold)
            rows = torch.from_numpy((train[:, None] * k + np.arange(k)).ravel())
            steps = estimator.warmup_steps + 4
            for chunk in torch.tensor_split(rows, steps):
                chunk = chunk[: chunk.numel() // 2 * 2]  # whole pairs: a prompt's k rollouts pair up in order
                estimator.observe(features[chunk], rewards[chunk])
            if not estimator.trusted:
                raise RuntimeError(f"{rule}: the probe is not trusted after {steps} steps; give more prompts")
            held = torch.from_numpy((np.flatnonzero(fold_of == fold)[:, None] * k + np.arange(k)).ravel())
            out[held.numpy()] = estimator.advantages(features[held], rewards[held]).values.double().numpy()
        if not np.isfinite(out).all():
            raise RuntimeError(f"{rule}: the probe gave non-finite values for {int((~np.isfinite(out)).sum())} rows")
        values[rule] = out
        log(f"      {CONTENDERS[rule].label}: cross-fitted probe values over {folds} folds of prompts")
    return values


# --------------------------------------------------------------------------------------------------- measuring
def needed_completions(budgets: Sequence[int], errors: Sequence[float], target: float) -> float:
    """Completions at which a contender's error curve reaches `target`, interpolated log-log between measured
    budgets (no 1/n law assumed): inf when even the largest budget misses it, the smallest budget when that one
    already reaches it (nothing below the measured range is claimed); NaN when a curve is undefined."""
    if math.isnan(target) or any(math.isnan(e) for e in errors):
        return math.nan
    log_n, log_e = np.log(np.asarray(budgets, float)), np.log(np.asarray(errors, float))
    if errors[0] <= target:
        return float(budgets[0])
    for i in range(1, len(budgets)):
        if errors[i] <= target:
            t = (math.log(target) - log_e[i - 1]) / (log_e[i] - log_e[i - 1])
            return float(math.exp(log_n[i - 1] + t * (log_n[i] - log_n[i - 1])))
    return math.inf


def measure(
    rewards: torch.Tensor,
    k: int,
    grams: dict[str, torch.Tensor],
    values: dict[str, np.ndarray],
    rules: Sequence[str],
    budgets: Sequence[int],
    num_batches: int,
    bootstrap: int,
    bootstrap_batches: int,
    seed: int,
) -> dict[str, Any]:
    """Per subspace, rule and budget: `batch_errors` with bias-corrected 95% intervals over bootstrap resamples of
    the pool's prompts; and the completions each rule needs to reach POISE (default)'s best-scale error at
    `REFERENCE_BUDGET`, as a share POISE's completions are of them."""
    r = rewards.double().numpy()
    num_prompts = r.size // k
    out: dict[str, Any] = {}
    for subspace, k_matrix in grams.items():
        rng = np.random.default_rng(seed)
        pools = [np.arange(num_prompts)] + [rng.integers(num_prompts, size=num_prompts) for _ in range(bootstrap)]
        cells: dict[tuple[str, int], list[dict[str, float]]] = {}
        for rep, pool in enumerate(pools):
            w_ref = reference_weights(rewards, k, np.bincount(pool, minlength=num_prompts).astype(float))
            for rule in rules:
                for budget in budgets:
                    num = num_batches if rep == 0 else bootstrap_batches
                    batches = draw_batches(rule, budget, r, k, pool, num, rng, values)
                    cells.setdefault((rule, budget), []).append(batch_errors(batches, k_matrix, w_ref))
            if rep == 0 and math.isnan(cells[rules[0], budgets[0]][0]["relative_mse"]):
                raise ValueError("no prompt of the pool has mixed rewards, so there is no policy gradient to "
                                 "estimate: use more prompts, more rollouts per prompt, or a task the model solves "
                                 "sometimes")  # fmt: skip
        table: dict[str, dict[int, dict[str, Any]]] = {rule: {} for rule in rules}
        for (rule, budget), reps in cells.items():
            cell = dict(reps[0], variance=reps[0]["relative_mse"] - reps[0]["bias"])
            if bootstrap:
                for key in ("relative_mse", "cosine", "best_scale_mse"):
                    cell[f"{key}_ci"] = bias_corrected_interval(cell[key], np.array([c[key] for c in reps[1:]]))
            table[rule][budget] = cell
        needed: dict[str, Any] = {}
        if "poise" in rules and REFERENCE_BUDGET in budgets:
            for rule in rules:
                shares = [
                    REFERENCE_BUDGET
                    / needed_completions(budgets, [cells[rule, b][rep]["best_scale_mse"] for b in budgets],
                                         cells["poise", REFERENCE_BUDGET][rep]["best_scale_mse"])
                    for rep in range(len(pools))
                ]  # fmt: skip
                needed[rule] = {
                    "completions": REFERENCE_BUDGET / shares[0] if shares[0] > 0 else math.inf,
                    "poise_share": shares[0],
                    "poise_share_ci": bias_corrected_interval(shares[0], np.array(shares[1:])) if bootstrap else None,
                    "goal": GOALS.get(rule),
                }
        out[subspace] = {"table": table, "needed": needed}
    return out


def ranking_agreement(results: dict[str, Any], budgets: Sequence[int]) -> dict[int, float]:
    """Kendall's tau between the two subspaces' orderings of the rules by best-scale error, per budget."""
    from scipy.stats import kendalltau

    a, b = (results[s]["table"] for s in SUBSPACES)
    return {n: float(kendalltau([a[r][n]["best_scale_mse"] for r in a], [b[r][n]["best_scale_mse"] for r in a])[0])
            for n in budgets}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- report
def _ci(ci: Sequence[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:.3f}, {ci[1]:.3f}]"


def format_report(results: dict[str, Any]) -> str:
    pool, s = results["pool"], results["settings"]
    lines = [
        f"# bench gradient: {pool['model_name']} on {pool['dataset']}",
        "",
        f"Pool: {pool['prompts']} prompts x {pool['k']} rollouts, mean reward {pool['mean_reward']:.3f}, "
        f"{pool['mixed_share']:.0%} of prompts with mixed outcomes. {s['batches']} batches per contender and budget; "
        f"95% CIs over {s['bootstrap']} bootstrap resamples of the prompts ({s['bootstrap_batches']} batches each). "
        "Errors are relative to the reference's squared norm: relative MSE = bias² + variance; the best-scale MSE is "
        "that of c·ĝ with the best constant c (what a tuned learning rate leaves; for unbiased rules a monotone "
        "function of the plain MSE). Intervals: bias-corrected bootstrap.",
    ]
    for subspace in SUBSPACES:
        block = results["subspaces"][subspace]
        lines += ["", f"## Subspace: {subspace} ({results['dimensions'][subspace]} dimensions)", ""]
        rows = []
        for rule, cells in block["table"].items():
            for budget, c in cells.items():
                rows.append([
                    CONTENDERS[rule].label, str(budget), f"{c['relative_mse']:.3f}{_ci(c.get('relative_mse_ci'))}",
                    f"{c['bias']:.3f}", f"{c['variance']:.3f}", f"{c['cosine']:.3f}{_ci(c.get('cosine_ci'))}",
                    f"{c['best_scale_mse']:.3f}{_ci(c.get('best_scale_mse_ci'))}",
                ])  # fmt: skip
        headers = ["Contender", "Completions", "Rel. MSE", "Bias²", "Variance", "Cosine", "Rel. MSE, best scale"]
        lines.append(format_table(headers, rows))
        if block["needed"]:
            lines += ["", f"Completions needed to reach POISE (default)'s best-scale error at {REFERENCE_BUDGET} "
                      "(POISE's share = its completions / theirs; the goal is met when the interval's top is below "
                      "it):", ""]  # fmt: skip
            rows = []
            for rule, c in block["needed"].items():
                goal = "" if c["goal"] is None else f"<= {c['goal']}"
                met = "" if c["goal"] is None or c["poise_share_ci"] is None else (
                    "met" if c["poise_share_ci"][1] <= c["goal"] else "not met")  # fmt: skip
                rows.append([CONTENDERS[rule].label, f"{c['completions']:.0f}",
                             f"{c['poise_share']:.2f}{_ci(c['poise_share_ci'])}", goal, met])  # fmt: skip
            lines.append(format_table(["Contender", "Completions", "POISE's share", "Goal", "CI below goal"], rows))
    tau = results["ranking_agreement"]
    lines += ["", "Ranking agreement between subspaces (Kendall's tau by budget): "
              + ", ".join(f"{n}: {t:+.2f}" for n, t in tau.items())]  # fmt: skip
    seconds = results["seconds"]
    lines += ["", "Time: " + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())]
    return "\n".join(lines) + "\n"


def plot_curves(results: dict[str, Any], path: Path) -> Path:
    """Best-scale relative MSE against completions, log-log, one line per contender with its interval band, one panel
    per subspace."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SUBSPACES), figsize=(11, 4.2))
    for ax, subspace in zip(axes, SUBSPACES, strict=True):
        for rule, cells in results["subspaces"][subspace]["table"].items():
            budgets = [int(b) for b in cells]
            ax.plot(budgets, [c["best_scale_mse"] for c in cells.values()], marker="o", label=CONTENDERS[rule].label)
            if all("best_scale_mse_ci" in c for c in cells.values()):
                low, high = zip(*(c["best_scale_mse_ci"] for c in cells.values()), strict=True)
                ax.fill_between(budgets, low, high, alpha=0.15)
        ax.set(xscale="log", yscale="log", xlabel="completions generated", ylabel="relative MSE at the best scale",
               title=subspace)  # fmt: skip
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_gradient(args: argparse.Namespace, log: Log = print) -> int:
    """Handler of `poise-trl bench gradient`: sample the pool, take per-rollout gradients, fit the probes, measure."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    budgets = sorted(args.budgets)
    largest = max(CONTENDERS[r].group_size for r in args.contenders)
    if args.k < largest:
        raise SystemExit(f"--k {args.k}: the pool needs at least G={largest} rollouts per prompt for every contender")
    collection = collect_from_args(args, log)
    seconds = {k: float(v) for k, v in collection.meta["seconds"].items()}
    model = AutoModelForCausalLM.from_pretrained(collection.meta["model_path"], dtype=torch.float32)
    model.to(resolve_device(args.device))
    log(f"[3/4] per-rollout gradients of {collection.rewards.numel()} rollouts (LoRA r={args.lora_rank} and norms)")
    t = time.perf_counter()
    gradients = rollout_gradients(model, collection, args.lora_rank, args.seed, log)
    grams = {name: gram(g, collection.k) for name, g in gradients.items()}
    seconds["gradients"] = time.perf_counter() - t
    t = time.perf_counter()
    values = cross_fitted_values(collection, args.folds, args.seed, log)
    seconds["probes"] = time.perf_counter() - t
    log(f"[4/4] {args.batches} batches per contender and budget, {args.bootstrap} bootstrap resamples")
    t = time.perf_counter()
    rewards = collection.rewards.nan_to_num(0.0)
    measured = measure(rewards, collection.k, grams, values, args.contenders, budgets, args.batches, args.bootstrap,
                       args.bootstrap_batches, args.seed)  # fmt: skip
    seconds["measure"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - start
    by_prompt = collection.rewards.view(-1, collection.k)
    results = {
        "pool": {
            "model_name": args.model,
            "model_path": collection.meta["model_path"],
            "dataset": collection.meta["dataset"],
            "prompts": collection.num_prompts,
            "k": collection.k,
            "mean_reward": float(collection.rewards.nanmean()),
            "mixed_share": float(((by_prompt.amax(1) > by_prompt.amin(1))).float().mean()),
            "mean_completion_tokens": collection.meta["mean_completion_tokens"],
        },
        "settings": {key: getattr(args, key) for key in ("batches", "bootstrap", "bootstrap_batches", "folds",
                                                         "lora_rank", "seed", "contenders")} | {"budgets": budgets},
        "dimensions": {name: int(g.size(1)) for name, g in gradients.items()},
        "subspaces": measured,
        "ranking_agreement": ranking_agreement(measured, budgets),
        "seconds": seconds,
    }  # fmt: skip
    write_json(output_dir / "results.json", results)
    report = format_report(results)
    (output_dir / "results.md").write_text(report)
    plot_curves(results, output_dir / "gradient.png")
    log(report)
    log(f"wrote {output_dir / 'results.json'}, results.md and gradient.png")
    return 0
