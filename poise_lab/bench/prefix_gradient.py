"""Per-rollout score gradients for `bench gradient`, and its per-prefix rows: a baseline V(x, y_<t) at every token.

A per-prefix baseline gives rollout i the contribution u_i = Σ_t (r_i − V_{i,t}) s_{i,t} = r_i g_i − h_i, with
s_{i,t} = ∇ log π(y_t | x, y_<t), g_i = Σ_t s_{i,t} and h_i = Σ_t V_{i,t} s_{i,t}, the gradient of Σ_t V_{i,t}
log π(y_t | ...) with V held fixed. So no per-token gradient is stored: one more backward pass of the forward that
gives g_i gives h_i, in the same two subspaces, and the rule is exact on the per-prompt family [g_1..g_K, h_1..h_K]
(`exact.prefix_moments`); the only approximation is the subspace, as for every row. E[h | x] = 0 when V_{i,t} reads
x and y_<t only; its estimate ||E h||² / ||g||² is reported as a check the pool can fail.

V comes from the per-prefix probe (`poise_trl.features.prefix`) fitted on the separate probe pool: its features from
the hooked layer's output in one no-grad pass per batch of probe-pool rollouts, then V for every token of the measured
pool from the same layer in the forward that the gradients take.
"""

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from poise_trl.features.features import find_decoder_layers

from .common import resolve_device
from .contenders import CONTENDERS, GRADIENT_PREFIX_ROWS, PREFIX_SAMPLED_ROW
from .exact import (
    PoolGram,
    RuleMoments,
    bootstrap_counts,
    distinct_pairs,
    family_mean,
    oracle_moments,
    point_and_interval,
    prefix_moments,
    summarize,
    truth_weights,
)
from .value.collect import Collection, Log
from .value.prefix import fit_prefix, prefix_probe_settings, rollout_token_values, sampled_rows

SUBSPACES = ("lora", "norms")
PREFIX_ROWS = GRADIENT_PREFIX_ROWS
PREFIX_LABELS = {**PREFIX_ROWS, PREFIX_SAMPLED_ROW[0]: PREFIX_SAMPLED_ROW[1]}  # the rows measured, with their labels
PREFIX_MIX = {"poise_prefix": 1.0, "poise_prefix_mix": 0.5}  # the weight of V_{i,t}; the rest is the partner's value
PREFIX_COMPARATORS = ("grpo8", "grpo8_noscale", "rloo2", "poise")
TokenValues = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""(rollout index, the hooked layer's output (L, d) over prompt + completion, the (T,) entropies of the distributions
that emitted the completion) -> (T,) V_{i,t}; it may read the output at positions before each token only."""


def rollout_gradients(
    model: Any,
    collection: Collection,
    lora_rank: int = 1,
    seed: int = 0,
    log: Log = print,
    token_values: TokenValues | None = None,
) -> dict[str, torch.Tensor]:
    """(N, D_s) float32 gradients of each rollout's sequence log-probability, one matrix per subspace (`SUBSPACES`);
    with `token_values`, also h_i = ∇ Σ_t V_{i,t} log π(y_t | x, y_<t) under "<subspace>_h", from a second backward
    pass of the same forward (V read off the hooked layer `collection.meta["default_layer"]`).

    The policy is the sampling policy: logits divided by the collection's temperature, as TRL scores completions."""
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import entropy_from_logits

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
    names = [*SUBSPACES, *(f"{s}_h" for s in SUBSPACES if token_values is not None)]
    out: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    states: list[torch.Tensor] = []
    handle = None
    if token_values is not None:
        layer = find_decoder_layers(peft_model)[int(collection.meta["default_layer"])]
        handle = layer.register_forward_hook(lambda m, a, o: states.append(o[0] if isinstance(o, tuple) else o))
    start = time.perf_counter()
    try:
        for i in range(collection.rewards.numel()):
            p = int(collection.prompt_index[i])
            prompt = collection.prompt_ids[p][collection.prompt_mask[p].bool()]
            completion = collection.completion_ids[i][collection.completion_mask[i].bool()].long()
            ids = torch.cat([prompt, completion]).to(device)[None]
            states.clear()
            logits = peft_model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float() / temperature
            token_log_probs = torch.log_softmax(logits, -1).gather(1, completion.to(device)[:, None])[:, 0]
            targets = [(token_log_probs.sum(), "")]
            if token_values is not None:
                values = token_values(i, states[0][0].detach(), entropy_from_logits(logits.detach()))
                if values.shape != completion.shape or not torch.isfinite(values).all():
                    raise RuntimeError(
                        f"rollout {i}: token values of shape {tuple(values.shape)}, not finite ones "
                        f"of shape {tuple(completion.shape)}"
                    )
                targets.append(((values.to(device).detach() * token_log_probs).sum(), "_h"))
            for n, (target, suffix) in enumerate(targets):
                grads = torch.autograd.grad(target, lora_b + norms, retain_graph=n + 1 < len(targets))
                out[f"lora{suffix}"].append(torch.cat([g.flatten() for g in grads[: len(lora_b)]]).float().cpu())
                out[f"norms{suffix}"].append(torch.cat([g.flatten() for g in grads[len(lora_b) :]]).float().cpu())
            if (i + 1) % 256 == 0:
                log(f"      gradients of {i + 1} rollouts: {time.perf_counter() - start:.0f}s")
    finally:
        if handle is not None:
            handle.remove()
        peft_model.unload()
    return {name: torch.stack(rows) for name, rows in out.items()}


def gram(gradients: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """G Gᵀ in float64, accumulated over column chunks (a float64 copy of every gradient would not fit)."""
    out = torch.zeros(gradients.size(0), gradients.size(0), dtype=torch.float64)
    for s in range(0, gradients.size(1), chunk):
        block = gradients[:, s : s + chunk].double()
        out += block @ block.T
    return out


def family_gram(g: torch.Tensor, h: torch.Tensor, k: int) -> torch.Tensor:
    """(2N, 2N) Gram of the family [g; h] in prompt-major order: a prompt's K g's, then its K h's."""
    family = torch.cat([g.view(-1, k, g.size(1)), h.view(-1, k, h.size(1))], dim=1)
    return gram(family.view(-1, g.size(1)))


# ----------------------------------------------------------------------------------------- the per-prefix probe
def prefix_token_values(model: Any, probe: Collection, keep: np.ndarray, seed: int = 0) -> TokenValues:
    """The per-prefix probe, with the trainer's settings (`prefix_probe_settings`), fitted on the sampled tokens of
    every rollout of the probe pool's prompts `keep`, as `rollout_gradients`' token values for the measured pool."""
    settings = prefix_probe_settings(probe.meta)
    rollouts = torch.from_numpy((keep[:, None] * probe.k + np.arange(probe.k)).ravel())
    rows, targets = sampled_rows(model, probe, rollouts, settings, seed=seed)
    prefix_map = fit_prefix(rows, targets, settings, int(probe.meta["hidden_size"]))

    def values(index: int, hidden: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
        completion = entropies.numel()
        return rollout_token_values(
            hidden, hidden.size(0) - completion, entropies, prefix_map.to(hidden.device), settings["pool_tokens"]
        )

    return values


def load_families(
    collection: Collection,
    probe: Collection,
    keep: np.ndarray,
    folder: Path,
    model_fn: Callable[[], Any],
    lora_rank: int,
    seed: int,
    log: Log = print,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The (2N, 2N) Gram matrices of [g; h] per subspace and {"seconds", "mean_value"}, from the pool's folder when
    an earlier run with the same per-prefix probe made them (the rows without prefix values never read this file)."""
    files = folder / "prefix_grams.safetensors", folder / "prefix_grams.json"
    settings = {**prefix_probe_settings(probe.meta), "probe_prompts": len(keep), "seed": seed}
    if all(f.exists() for f in files) and json.loads(files[1].read_text())["settings"] == json.loads(
        json.dumps(settings)
    ):
        log(f"[cache] per-prefix Gram matrices from {files[0]}")
        tensors = load_file(str(files[0]))
        return {name: tensors[name] for name in SUBSPACES}, json.loads(files[1].read_text())
    model = model_fn()
    log(f"      the per-prefix probe: {len(keep)} probe-pool prompts x {probe.k} rollouts, one pass per batch")
    t = time.perf_counter()
    token_values = prefix_token_values(model, probe, keep, seed)
    fit_s = time.perf_counter() - t
    log(f"      per-rollout g and h of {collection.rewards.numel()} rollouts (two backward passes each)")
    t = time.perf_counter()
    grads = rollout_gradients(model, collection, lora_rank, seed, log, token_values)
    families = {name: family_gram(grads[name], grads[f"{name}_h"], collection.k) for name in SUBSPACES}
    info = {"settings": settings, "seconds": {"prefix_probe": fit_s, "prefix_gradients": time.perf_counter() - t}}
    save_file({name: f.contiguous() for name, f in families.items()}, str(files[0]))
    files[1].write_text(json.dumps(info))
    return families, info


# ---------------------------------------------------------------------------------------------------- measuring
def measure_prefix(
    rewards: np.ndarray,
    comparators: dict[str, RuleMoments],
    partner: np.ndarray,
    families: dict[str, torch.Tensor],
    rules: list[str],
    bootstrap: int,
    seed: int,
    prompt_sampler: np.ndarray | None = None,
) -> dict[str, Any]:
    """Per subspace: the per-prefix rows' cells as `gradient.measure` makes them (variance and scale-matched
    variance in W, bias² in ||g||², shares of each comparator's completions, on the same bootstrap resamples), and
    the unbiasedness check ||E h||² / ||g||² (h with the per-prefix baseline's own V). With `prompt_sampler` (the
    probe sampler's q over the prompts) and poise_prefix among `rules`, poise_prefix again under that sampler."""
    num_prompts, k = rewards.shape
    counts = bootstrap_counts(num_prompts, bootstrap, seed)
    weights = counts / counts.sum(1, keepdims=True)
    pad = ((0, 0), (0, k), (0, k))
    truth = np.pad(truth_weights(rewards), pad[:2])
    _, noise, signal = oracle_moments(rewards)
    moments = {rule: m.padded(2 * k) for rule, m in comparators.items()}
    moments.update({rule: prefix_moments(rewards, PREFIX_MIX[rule], partner) for rule in rules})
    out: dict[str, Any] = {}
    for subspace, matrix in families.items():
        pool = PoolGram(num_prompts, 2 * k, gram=matrix.double().numpy())
        stats = {rule: summarize(pool, m, truth, counts) for rule, m in moments.items()}
        if prompt_sampler is not None and "poise_prefix" in rules:
            sampled = summarize(pool, moments["poise_prefix"], truth, counts, prompt_sampler)
            stats[PREFIX_SAMPLED_ROW[0]] = sampled
        gg = stats[rules[0]]["signal"]
        matched = {rule: s["variance"] * (gg / s["mean_dot"]) ** 2 for rule, s in stats.items()}
        within = weights @ (pool.second(np.pad(noise, pad)) - pool.second(np.pad(signal, pad)))
        table = {}
        for rule in [r for r in (*rules, PREFIX_SAMPLED_ROW[0]) if r in stats]:
            table[rule] = {
                "variance": point_and_interval(stats[rule]["variance"] / within),
                "bias2": point_and_interval(stats[rule]["bias2"] / gg),
                "matched_variance": point_and_interval(matched[rule] / within),
                **{f"share_{c}": point_and_interval(matched[rule] / matched[c]) for c in comparators},
            }
        mean_h = family_mean(num_prompts, k)
        check = distinct_pairs(pool.cross(mean_h, mean_h), counts) / gg
        out[subspace] = {"table": table, "mean_h_sq_over_signal": point_and_interval(check)}
    return out


def run_prefix(
    args: argparse.Namespace,
    collection: Collection,
    probe: Collection,
    keep: np.ndarray,
    folder: Path,
    rewards: np.ndarray,
    values: dict[str, np.ndarray],
    comparators: dict[str, RuleMoments],
    measured: dict[str, Any],
    prompt_sampler: np.ndarray | None = None,
    log: Log = print,
) -> dict[str, Any]:
    """The per-prefix rows asked for in --contenders (and poise_prefix under `prompt_sampler`), against the
    `comparators` among `PREFIX_COMPARATORS` (their sequence-level moments): added to `measured`'s tables; their
    check, probe and timing returned ({} when none was asked for)."""
    rules = [r for r in args.contenders if r in PREFIX_ROWS]
    if not rules:
        return {}

    def model() -> Any:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(collection.meta["model_path"], dtype=torch.float32)
        return loaded.to(resolve_device(args.device))

    families, info = load_families(collection, probe, keep, folder, model, args.lora_rank, args.seed, log)
    comparators = {c: comparators[c] for c in PREFIX_COMPARATORS if c in comparators}
    out = measure_prefix(
        rewards,
        comparators,
        values["poise"].reshape(rewards.shape),
        families,
        rules,
        args.bootstrap,
        args.seed,
        prompt_sampler,
    )
    for subspace, block in out.items():
        measured[subspace]["table"].update(block["table"])
    return {
        "probe": f"{len(keep)} prompts x {probe.k} rollouts, {info['settings']['samples']} positions each",
        "subspaces": out,
        "seconds": info["seconds"],
    }


def prefix_report(results: dict[str, Any], fmt: Callable[[dict[str, Any] | None, int], str]) -> list[str]:
    """The report's section on the per-prefix rows ([] when none ran)."""
    prefix = results.get("prefix")
    if not prefix:
        return []
    lines = [
        "",
        "## Per-prefix baselines",
        "",
        "A_{i,t} = r_i − V(x, y_<t) (and ½ V + ½ the partner's POISE (default) value), V from a per-prefix probe "
        f"fitted on the probe pool ({prefix['probe']}). Exact on the family [g; h], h_i = Σ_t V_(i,t) ∇log "
        "π(y_t | x, y_<t) (a second backward pass). Check: ||E h||² / ||g||², zero for a V that reads only x and "
        "y_<t; an interval that excludes 0 says the baseline is biased.",
        "",
    ]
    for subspace in SUBSPACES:
        block = prefix["subspaces"][subspace]
        for rule, cell in block["table"].items():
            shares = ", ".join(
                f"{CONTENDERS[c].label}: {fmt(cell[f'share_{c}'], 2)}"
                for c in PREFIX_COMPARATORS
                if f"share_{c}" in cell
            )
            lines.append(f"- {subspace}, {PREFIX_LABELS[rule]}: share of {shares}")
        lines.append(f"- {subspace}, ||E h||² / ||g||²: {fmt(block['mean_h_sq_over_signal'], 4)}")
    return lines
