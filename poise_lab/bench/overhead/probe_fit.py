"""`bench overhead`'s probe-fit timing: `ValueProbe` against scikit-learn on hidden-state-like data of one shape, and
every other value head's fit (`probe_head`) against ridge's on the same data."""

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from poise_trl.features.features import FeatureLayout
from poise_trl.heads.heads import HEADS
from poise_trl.heads.probe import ValueProbe

from ..common import PROBE_FIT_ROWS, QWEN3_4B_HIDDEN, summarize


def _probe_data(rows: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden-state-like features and a binary target that depends on them, so the fit has something to find.

    Each d-wide block is a 128-dim latent with a decaying spectrum (scale 1/j) plus weak noise, as hidden states
    are: its top principal components are well separated, so two PCA solvers agree on them and the predictions can
    be compared (with a flat noise floor, components past the signal would be arbitrary). 3 entropy-like columns.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    rank = 128
    latent = torch.randn(rows, rank, generator=g) / torch.arange(1, rank + 1)
    mixing = [torch.randn(rank, hidden, generator=torch.Generator().manual_seed(block)) for block in range(2)]
    blocks = [latent @ m + 0.01 * torch.randn(rows, hidden, generator=g) for m in mixing]
    entropy = torch.rand(rows, 3, generator=g) + latent[:, :3].abs()
    x = torch.cat([*blocks, entropy], dim=1)
    y = (latent[:, 0] + 0.5 * torch.randn(rows, generator=g) > 0).float()
    return x, y


def _median_seconds(fn: Callable[[], Any], repeats: int, sync: bool = False) -> float:
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return summarize(times)["median"]


def _fit_seconds(
    name: str, alpha: float, pca: list, x: torch.Tensor, y: torch.Tensor, repeats: int, gpu: bool
) -> float:
    """Median seconds of one fit of head `name` with a preset's settings (on the GPU: after one warm-up fit)."""
    head = HEADS[name](alpha=alpha, pca_dims=pca or None, clip=None)
    if gpu:
        x, y = x.cuda(), y.cuda()
        head.fit(x, y)  # warm-up: CUDA context, cuSOLVER handles
    return _median_seconds(partial(head.fit, x, y), repeats, sync=gpu)


def probe_fit_benchmark(
    repeats: int, hidden: int = QWEN3_4B_HIDDEN, rows: int = PROBE_FIT_ROWS, heads: list[str] | None = None
) -> list[dict]:
    """ValueProbe vs scikit-learn on the same (rows, 2*hidden + 3) data, same thread count, for both presets; and each
    head of `heads` (None: every head but ridge) against ridge, with the preset's alpha and PCA, as
    `{name: {"torch_cpu_seconds", "cpu_ratio_to_ridge"[, "torch_gpu_seconds", "gpu_ratio_to_ridge"]}}`."""
    heads = [name for name in HEADS if name != ValueProbe.name] if heads is None else heads
    unknown = sorted(set(heads) - set(HEADS))
    if unknown:
        raise ValueError(f"Unknown value heads {unknown}: choose from {sorted(HEADS)}.")
    import numpy as np
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    from poise_trl.presets import preset_value

    layout = FeatureLayout()  # the default φ: prompt, reasoning, the paper's three entropy statistics
    x, y = _probe_data(rows, hidden)
    x_new, _ = _probe_data(512, hidden, seed=1)
    x64, y64, x_new64 = x.double().numpy(), y.double().numpy(), x_new.double().numpy()
    results = []
    for preset in ("paper", "release"):
        alpha, dims = preset_value("probe_alpha", preset), preset_value("probe_pca_dims", preset)
        pca = layout.pca_blocks(hidden, dims)
        probe = ValueProbe(alpha=alpha, pca_dims=pca or None, clip=None)
        torch_seconds = _median_seconds(partial(probe.fit, x, y), repeats)
        ours = probe.predict(x_new).double().numpy()
        steps = [StandardScaler()]
        if pca:
            transformers = [(f"pca{i}", PCA(k, random_state=0), list(range(a, b))) for i, (a, b, k) in enumerate(pca)]
            steps.append(ColumnTransformer(transformers, remainder="passthrough"))
        reference = make_pipeline(*steps, Ridge(alpha=alpha))
        with threadpool_limits(limits=torch.get_num_threads()):
            sklearn_seconds = _median_seconds(partial(reference.fit, x64, y64), repeats)
        theirs = reference.predict(x_new64)
        result = {
            "preset": preset,
            "alpha": alpha,
            "pca_blocks": pca,
            "shape": [rows, int(sum(layout.sizes(hidden).values()))],
            "threads": torch.get_num_threads(),
            "torch_cpu_seconds": torch_seconds,
            "sklearn_seconds": sklearn_seconds,
            "max_abs_prediction_difference": float(np.abs(ours - theirs).max()),
            "prediction_correlation": float(np.corrcoef(ours, theirs)[0, 1]),
            "prediction_std": float(theirs.std()),
        }
        if torch.cuda.is_available():
            result["torch_gpu_seconds"] = _fit_seconds(ValueProbe.name, alpha, pca, x, y, repeats, gpu=True)
        result["heads"] = {}
        for name in heads:
            row = {"torch_cpu_seconds": _fit_seconds(name, alpha, pca, x, y, repeats, gpu=False)}
            row["cpu_ratio_to_ridge"] = row["torch_cpu_seconds"] / torch_seconds
            if torch.cuda.is_available():
                row["torch_gpu_seconds"] = _fit_seconds(name, alpha, pca, x, y, repeats, gpu=True)
                row["gpu_ratio_to_ridge"] = row["torch_gpu_seconds"] / result["torch_gpu_seconds"]
            result["heads"][name] = row
        results.append(result)
    return results
