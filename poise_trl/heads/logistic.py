"""`LogisticProbe`: the sigmoid-BCE value head (holi-lab/POISE's `sigmoid_bce`) on the shared front end. Pure torch.

A logistic link trained to the soft-label cross-entropy, so predictions can reach the ends of the reward range on
prompts the policy always fails or solves, where a clipped linear probe rarely lands exactly:

    minimize  sum_i BCE(sigmoid(f_i . w + b), t_i) + (alpha / 2) ||w||^2      (intercept b unpenalized)

which is scikit-learn's `LogisticRegression(C=1/alpha)` on the same standardized design (its objective is
C * sum_i loss_i + ||w||^2 / 2), and the official code's mean BCE + alpha / (2N) ||w||^2. The penalty means what
ridge's alpha means: (alpha / 2) ||w||^2 beside the negative log-likelihood (ridge's is half the squared error).

Targets need not be 0/1: the link spans the range predictions are clipped to (a fixed `clip`, else the observed
target range), t = (y - low) / (high - low), and value = low + (high - low) * sigmoid(logit). Targets outside a
fixed clip range count as its ends. t is clamped to [1e-6, 1 - 1e-6] (the official `sigmoid_bce_eps`): a buffer
whose targets are all 0 or all 1 then has a finite optimum (intercept logit(1e-6)) instead of an unbounded one.

The solver is Newton's method (IRLS) in float64 on the inputs' device, a fixed number of steps from w = 0 and the
intercept at the mean target's logit, each step a Cholesky solve: of the (P + 1)-square Hessian when the design has
P <= N columns, otherwise in the dual (w = F'a, the N x N kernel FF' computed once), as ridge chooses. Each step
takes the best of a few step lengths (1, 1/2, 1/4, 1/8, 0) by the objective, chosen on the device: nothing is read
on the host, and the objective never rises.
"""

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from .probe import ScaledHead, _solve_spd

EPS = 1e-6  # targets are clamped to [EPS, 1 - EPS]
# From w = 0, 16 steps reached the optimum to 1e-15 on separable 1000 x 3000 data at alpha 0.01 (12 steps: 8e-4).
NEWTON_STEPS = 16
STEP_LENGTHS = (1.0, 0.5, 0.25, 0.125, 0.0)  # 0 keeps the iterate where every other length would raise the loss
MIN_WEIGHT = 1e-10  # IRLS weights p(1 - p) are floored: any positive weight leaves the Newton fixed point unchanged


def _step_length(
    logits: torch.Tensor, direction: torch.Tensor, targets: torch.Tensor, penalty: torch.Tensor, alpha: float
) -> torch.Tensor:
    """The step length (0-d tensor) of `STEP_LENGTHS` with the lowest objective along `direction` of the logits;
    `penalty` = (w.w, w.dw, dw.dw), the L2 term along the step."""
    s = torch.tensor(STEP_LENGTHS, dtype=logits.dtype, device=logits.device)
    z = logits + s[:, None] * direction
    loss = (F.softplus(z) - targets * z).sum(1) + alpha / 2 * (penalty[0] + 2 * s * penalty[1] + s * s * penalty[2])
    return s[loss.argmin()]


class LogisticProbe(ScaledHead):
    """The sigmoid-BCE head (module docstring); settings as `ScaledHead`'s."""

    name = "logistic"

    @staticmethod
    def _link(y64: torch.Tensor, clip: torch.Tensor) -> torch.Tensor:
        """[low, width] of the range the link spans: the clip range where finite, else the observed targets'."""
        observed = torch.stack([y64.min(), y64.max()])
        bounds = torch.where(clip.isfinite(), clip, observed)
        width = bounds[1] - bounds[0]
        return torch.stack([bounds[0], torch.where(width > 0, width, torch.ones_like(width))])

    def _solve(self, design: torch.Tensor, y64: torch.Tensor, clip: torch.Tensor) -> dict[str, torch.Tensor]:
        link = self._link(y64, clip)
        t = ((y64 - link[0]) / link[1]).clamp(EPS, 1 - EPS)
        n, p = design.shape
        b = torch.logit(t.mean()).reshape(1)
        if p <= n:
            coef, b = self._primal(design, t, b)
        else:
            coef, b = self._dual(design, t, b)
        return {"link": link, "coef": coef, "intercept": b}

    def _primal(self, design: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Newton on theta = [w, b] with the (P + 1)-square Hessian F~'WF~ + diag(alpha, ..., alpha, 0)."""
        augmented = torch.cat([design, torch.ones_like(design[:, :1])], dim=1)
        penalty = torch.full((augmented.size(1),), self.alpha, dtype=design.dtype, device=design.device)
        penalty[-1] = 0.0
        theta = torch.cat([torch.zeros_like(design[0]), b])
        for _ in range(NEWTON_STEPS):
            logits = augmented @ theta
            prob = torch.sigmoid(logits)
            weight = (prob * (1 - prob)).clamp(min=MIN_WEIGHT)
            gradient = augmented.T @ (prob - t) + penalty * theta
            step = -_solve_spd(augmented.T @ (weight[:, None] * augmented), penalty, gradient)
            w, dw = theta[:-1], step[:-1]
            terms = torch.stack([w @ w, w @ dw, dw @ dw])
            theta = theta + _step_length(logits, augmented @ step, t, terms, self.alpha) * step
        return theta[:-1], theta[-1:]

    def _dual(self, design: torch.Tensor, t: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Newton in the dual, w = F'a (the optimum lies in the rows' span): each step is the IRLS weighted ridge
        (WK + alpha I) a' + W1 b' = Wz + t - p with 1'a' = 0, solved symmetrically through a' = sqrt(W) c."""
        kernel = design @ design.T
        a = torch.zeros_like(t)
        logits = b.expand_as(t)
        for _ in range(NEWTON_STEPS):
            prob = torch.sigmoid(logits)
            root = (prob * (1 - prob)).clamp(min=MIN_WEIGHT).sqrt()
            system = root[:, None] * kernel * root[None, :]
            v = root * logits + (t - prob) / root
            solved = _solve_spd(system, self.alpha, torch.stack([v, root], dim=1))
            b_new = (root @ solved[:, 0]) / (root @ solved[:, 1])
            da, db = root * (solved[:, 0] - b_new * solved[:, 1]) - a, b_new - b
            k_da = kernel @ da
            terms = torch.stack([a @ (logits - b), a @ k_da, da @ k_da])
            length = _step_length(logits, k_da + db, t, terms, self.alpha)
            a, b, logits = a + length * da, b + length * db, logits + length * (k_da + db)
        return design.T @ a, b.reshape(1)

    def _raw(self, design: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        link = tensors["link"]
        return link[0] + link[1] * torch.sigmoid(design @ tensors["coef"] + tensors["intercept"])
