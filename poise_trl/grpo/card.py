"""The model card's POISE section, from a `POISEConfig` and the run's logged diagnostics."""

import math
from statistics import fmean
from typing import TYPE_CHECKING, Any

from ..features.features import FeatureLayout

if TYPE_CHECKING:
    from .config import POISEConfig


DIAGNOSTICS = {"variance_reduction": "variance reduction", "pearson_r": "Pearson r", "mae": "MAE"}  # poise/* keys


def late_diagnostics(log_history: list[dict[str, Any]], steps: int) -> tuple[dict[str, float], int]:
    """Each probe diagnostic's mean over the training logs made in the last quarter of a run of `steps` steps (from
    step `steps * 3 // 4 + 1` on, the step also returned), NaN where none of them holds it: one step's value can be
    missing (a step whose rewards all tie has no Pearson r) or noisy, and the run's end is what its probe became."""
    first = steps * 3 // 4 + 1
    late = [log for log in log_history if log.get("step", 0) >= first]
    values = {}
    for key in DIAGNOSTICS:
        logged = [log[f"poise/{key}"] for log in late if log.get(f"poise/{key}") is not None]
        values[key] = fmean(logged) if logged else math.nan
    return values, first


def card_section(
    args: "POISEConfig",
    layer: int,
    layers: list[int],
    log_history: list[dict[str, Any]],
    steps: int,
    probe_file: str,
    probe_saved: bool,
) -> str:
    """The model card's "POISE" section: what a reader needs to reproduce the run, the probe diagnostics of its last
    quarter (`late_diagnostics` of the trainer state's `log_history` after `steps` steps) and how to warm-start from
    the probe (`probe_saved`: the card's folder holds the estimator file, `probe_file`). `layer`: the layer in use;
    `layers`: the candidates."""
    diagnostics, first = late_diagnostics(log_history, steps)

    def shown(key: str) -> str:
        value = diagnostics[key]
        return "not logged" if math.isnan(value) else f"{value:.4f}"

    window = f"mean of the logs of steps {first}-{steps}, the last quarter of training" if steps else "no step trained"
    diagnostics_line = "- Probe diagnostics ({}): {}".format(
        window, ", ".join(f"{name} {shown(key)}" for key, name in DIAGNOSTICS.items())
    )
    if probe_saved:
        warm_start = (
            f"- Warm start: the probe is saved beside the weights (`{probe_file}`); "
            "`POISEConfig(probe_init_path=...)` with this folder (for a Hub repository, the folder "
            "`huggingface_hub.snapshot_download` returns) starts a new run's probe from it, a fitted probe in use "
            "from the first step"
        )
    else:
        warm_start = (
            "- Warm start: the probe is not saved beside the weights; `trainer.save_model()` writes it "
            f"(`{probe_file}`), and `POISEConfig(probe_init_path=...)` with that folder starts a new "
            "run's probe from it"
        )

    selection = str(args.prompt_selection)
    if args.prompt_selection is not None:
        floor = f", floor {args.prompt_selection_floor}" if args.prompt_selection == "importance" else ""
        selection += f" (oversample {args.prompt_selection_oversample}{floor})"
    scalars = list(FeatureLayout.from_config(args).read_scalars) or "none"
    changes = args.preset_changes()
    changed = ", ".join(f"{key}={value!r} (the preset's: {preset!r})" for key, (preset, value) in changes.items())
    history = "off"
    if args.probe_history:
        history = f"on ({args.probe_history_size} prompts, decay {args.probe_history_decay})"
    lines = [
        "## POISE",
        "",
        "Advantages `A_i = r_i - b_i`, where `b_i` is the mean of the other rollouts' value-probe predictions "
        "from the policy's own hidden states (cross-rollout baseline, arXiv 2605.07579).",
        "",
        f"- Rollouts per prompt (G): {args.num_generations}",
        f"- Probe preset: {args.probe_preset} (probe_alpha={args.probe_alpha}, probe_pca_dims="
        f"{args.probe_pca_dims}, probe_clip_range={args.probe_clip_range}, probe_buffer_size="
        f"{args.probe_buffer_size}, probe_warmup_steps={args.probe_warmup_steps})",
        f"- Changed from probe_preset={args.probe_preset!r}: {changed or 'nothing'}",
        f"- Value head (probe_head): {args.probe_head}; granularity (probe_granularity): {args.probe_granularity}",
        f"- Probe layer: {'default' if args.probe_layer is None else args.probe_layer} (in use: {layer}; "
        f"candidates: {layers})",
        f"- Features (probe_features): {list(args.probe_features)}, pooled over the last {args.probe_pool_tokens} "
        f"tokens; rollout scalars (probe_scalars): {scalars}",
        f"- Partner-aware probe (probe_partner_reward): {args.probe_partner_reward}",
        f"- Prompt history (probe_history): {history}",
        f"- Bootstrap (probe_bootstrap): {args.probe_bootstrap}; schedule (probe_schedule): {args.probe_schedule}; "
        f"whole-group buffers (probe_buffer_whole_groups): {args.probe_buffer_whole_groups}; domain routing "
        f"(probe_domain_routing): {args.probe_domain_routing}; reward range (probe_reward_range): "
        f"{args.probe_reward_range}",
        f"- Prompt selection: {selection}",
        diagnostics_line,
        warm_start,
        "",
    ]
    return "\n".join(lines)
