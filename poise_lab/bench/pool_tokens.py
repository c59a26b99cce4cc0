"""`poise-trl bench pool-tokens`: the per-token entropies of a pool sampled before pools kept them.

A pool of `bench gradient` (its folder) holds each rollout's ids, masks, reward and feature row, the row's entropy
statistics but not the entropies they average. This teacher-forces the stored completions through the model that
sampled them, in the batches `collect` fed it, and writes each file's `CompletionTokens` beside it only if that pass
reproduces the file's stored feature rows: every block (both hidden-state blocks, the entropy statistics, the length)
within `--tolerance`. A model that did not sample the pool (a snapshot retrained on another CPU) is refused with the
differences, and nothing is written.
"""

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from poise_trl.features.features import FEATURE_BLOCKS, FeatureLayout

from .common import resolve_device
from .value.collect import Collection, CompletionTokens, Log, extract_features, marker_token_ids, tokens_path

POOL_FILES = ("pool", "probe_pool")


def block_differences(recomputed: torch.Tensor, stored: torch.Tensor, hidden_size: int) -> dict[str, float]:
    """The largest absolute difference of each feature block (`FEATURE_BLOCKS`) between two (N, C, 2d+4) rows."""
    return {
        name: float((recomputed[..., start:stop] - stored[..., start:stop]).abs().max())
        for name, (start, stop) in FeatureLayout(FEATURE_BLOCKS).slices(hidden_size).items()
    }


def teacher_force(
    collection: Collection, model: Any, tokenizer: Any, batch_size: int = 64
) -> tuple[CompletionTokens, dict[str, float]]:
    """The collection's `CompletionTokens` from one teacher-forced pass over its stored rows (the captures, marker,
    temperature and padding `collect` used), and the largest difference of each block of the rows that pass makes
    from the stored ones."""
    meta = collection.meta
    prompts, completions = collection.rows()
    marker_ids = marker_token_ids(tokenizer, meta["reasoning_end_marker"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    features, entropies, logprobs = extract_features(
        model, prompts, completions, collection.captures, marker_ids, pad_id, float(meta["temperature"]), batch_size
    )
    differences = block_differences(features, collection.features, int(meta["hidden_size"]))
    texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
    source = {"pass": "teacher-forced after sampling (bench pool-tokens)", "max_abs_difference": differences}
    return CompletionTokens(entropies, logprobs, texts, marker_ids, source), differences


def run_pool_tokens(args: argparse.Namespace, log: Log = print) -> int:
    """Handler of `poise-trl bench pool-tokens`: each pool file of the folder teacher-forced, checked, written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(args.folder)
    paths = {name: folder / f"{name}.safetensors" for name in POOL_FILES}
    if missing := [str(p) for p in paths.values() if not p.exists()]:
        raise SystemExit(f"{folder} is not a pool of `bench gradient`: {', '.join(missing)} missing")
    collections = {name: Collection.load(path) for name, path in paths.items()}
    model_path = args.model or collections["pool"].meta["model_path"]
    log(f"teacher-forcing {folder}'s stored completions through {model_path}")
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(resolve_device(args.device))
    model.eval()
    made, passed = {}, True
    for name, collection in collections.items():
        start = time.perf_counter()
        made[name], differences = teacher_force(collection, model, tokenizer, args.batch_size)
        made[name].source.update(model=str(model_path), seconds=time.perf_counter() - start)
        passed &= max(differences.values()) <= args.tolerance
        shown = ", ".join(f"{block} {value:.2e}" for block, value in differences.items())
        log(
            f"  {name}: {collection.rewards.numel()} rollouts in {made[name].source['seconds']:.0f} s; largest "
            f"|recomputed - stored| per block: {shown}"
        )
    if not passed:
        log(
            f"refused: a block differs by more than --tolerance {args.tolerance}, so {model_path} is not the model "
            "that sampled this pool (or not on this machine's arithmetic); nothing written"
        )
        return 1
    for name, tokens in made.items():
        log(f"  wrote {tokens.save(tokens_path(paths[name]))}")
    return 0
