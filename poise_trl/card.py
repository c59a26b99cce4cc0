"""The model card's POISE section, from a `POISEConfig` and the last logged diagnostics."""

import math
from typing import TYPE_CHECKING

from .features import FeatureLayout

if TYPE_CHECKING:
    from .config import POISEConfig


def card_section(args: "POISEConfig", layer: int, layers: list[int], diagnostics: dict[str, float], step: int) -> str:
    """The model card's "POISE" section: what a reader needs to reproduce the run, and the last logged probe
    diagnostics (`layer`: the layer in use; `layers`: the candidates)."""

    def shown(key: str) -> str:
        value = diagnostics.get(key, math.nan)
        return "not logged" if value is None or math.isnan(value) else f"{value:.4f}"

    selection = str(args.prompt_selection)
    if args.prompt_selection is not None:
        floor = f", floor {args.prompt_selection_floor}" if args.prompt_selection == "importance" else ""
        selection += f" (oversample {args.prompt_selection_oversample}{floor})"
    scalars = list(FeatureLayout.from_config(args).read_scalars) or "none"
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
        f"- Value head (probe_head): {args.probe_head}; granularity (probe_granularity): {args.probe_granularity}",
        f"- Probe layer: {'default' if args.probe_layer is None else args.probe_layer} (in use: {layer}; "
        f"candidates: {layers})",
        f"- Features (probe_features): {list(args.probe_features)}, pooled over the last {args.probe_pool_tokens} "
        f"tokens; rollout scalars (probe_scalars): {scalars}",
        f"- Partner-aware probe (probe_partner_reward): {args.probe_partner_reward}",
        f"- Prompt history (probe_history): {history}",
        f"- Bootstrap (probe_bootstrap): {args.probe_bootstrap}",
        f"- Prompt selection: {selection}",
        f"- Last logged probe diagnostics (step {step}): variance reduction {shown('variance_reduction')}, "
        f"Pearson r {shown('pearson_r')}, MAE {shown('mae')}",
        "",
    ]
    return "\n".join(lines)
