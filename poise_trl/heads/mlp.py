"""`MLPProbe`: one hidden ReLU layer on the shared front end, holi-lab/POISE's `mlp` head. Pure torch.

It is scikit-learn's `MLPRegressor(hidden_layer_sizes=(hidden,), activation="relu", solver="adam",
alpha=alpha, learning_rate_init=learning_rate, batch_size=N, max_iter=iterations)` as the official code fits it
(hidden 64, 1000 epochs of one full batch, learning rate 1e-3), on the same standardized, PCA-reduced design:

    minimize  (1/2) mean_i (y_i - mlp(f_i))^2 + alpha / (2N) (||W1||^2 + ||w2||^2)      (biases unpenalized)

the penalty meaning ridge's alpha (half the squared error summed, plus (alpha / 2) ||w||^2). The weights start
from scikit-learn's Glorot-uniform draw, seeded on the host (so every device and process starts alike), and take
exactly `iterations` full-batch Adam steps with scikit-learn's update: no early stopping, no host read, the same
fit for the same rows. Gradients are written out (one hidden layer needs no autograd), so it fits under
`torch.no_grad` or `torch.inference_mode` and on inference tensors. Float64, as the rest of the front end.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .probe import PCABlock, ScaledHead

BETA1, BETA2, ADAM_EPS = 0.9, 0.999, 1e-8  # scikit-learn's Adam defaults


class MLPProbe(ScaledHead):
    """One hidden ReLU layer trained by full-batch Adam (module docstring).

    Args:
        alpha, pca_dims, clip: as `ScaledHead`'s.
        hidden: width of the hidden layer.
        iterations: full-batch Adam steps.
        learning_rate: Adam's step size.
        seed: seeds the initial weights.
    """

    name = "mlp"

    def __init__(
        self,
        alpha: float = 1.0,
        pca_dims: int | Sequence[PCABlock] | None = None,
        clip: tuple[float, float] | str | None = "observed",
        hidden: int = 64,
        iterations: int = 1000,
        learning_rate: float = 1e-3,
        seed: int = 0,
    ):
        super().__init__(alpha, pca_dims, clip)
        for key, value in (("hidden", hidden), ("iterations", iterations)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}={value!r} must be an int >= 1.")
        if not learning_rate > 0:
            raise ValueError(f"learning_rate={learning_rate!r} must be > 0.")
        self.hidden, self.iterations, self.learning_rate, self.seed = hidden, iterations, float(learning_rate), seed

    def config(self) -> dict[str, Any]:
        return {
            **super().config(),
            "hidden": self.hidden,
            "iterations": self.iterations,
            "learning_rate": self.learning_rate,
            "seed": self.seed,
        }

    def _initial(self, inputs: int, device: torch.device) -> list[torch.Tensor]:
        """[W1 (P, H), b1 (H,), w2 (H,), b2 (1,)]: Glorot uniform with scikit-learn's ReLU factor 6, from the seed."""
        generator = torch.Generator().manual_seed(self.seed)
        params = []
        for fan_in, fan_out in ((inputs, self.hidden), (self.hidden, 1)):
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            for shape in ((fan_in, fan_out), (fan_out,)):
                draw = torch.rand(shape, generator=generator, dtype=torch.float64)
                params.append(((2 * draw - 1) * bound).to(device))
        params[2] = params[2].squeeze(1)
        return params

    def _solve(self, design: torch.Tensor, y64: torch.Tensor, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        n = design.size(0)
        params = self._initial(design.size(1), design.device)
        first = [torch.zeros_like(p) for p in params]
        second = [torch.zeros_like(p) for p in params]
        for step in range(1, self.iterations + 1):
            w1, b1, w2, b2 = params
            before = design @ w1 + b1
            hidden = before.clamp(min=0)
            delta = (hidden @ w2 + b2 - y64) / n  # d loss / d output
            back = (delta[:, None] * w2) * (before > 0)
            grads = [
                design.T @ back + self.alpha / n * w1,
                back.sum(0),
                hidden.T @ delta + self.alpha / n * w2,
                delta.sum().reshape(1),
            ]
            rate = self.learning_rate * math.sqrt(1 - BETA2**step) / (1 - BETA1**step)
            for p, m, v, g in zip(params, first, second, grads, strict=True):
                m.mul_(BETA1).add_(g, alpha=1 - BETA1)
                v.mul_(BETA2).addcmul_(g, g, value=1 - BETA2)
                p.sub_(rate * m / (v.sqrt() + ADAM_EPS))
        return dict(zip(("hidden_weight", "hidden_bias", "coef", "intercept"), params, strict=True))

    def _raw(self, design: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        hidden = (design @ tensors["hidden_weight"] + tensors["hidden_bias"]).clamp(min=0)
        return hidden @ tensors["coef"] + tensors["intercept"]
