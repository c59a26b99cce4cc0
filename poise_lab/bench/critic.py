"""The paper's critic baseline (App. D.1, SPPO-style): a copy of the policy backbone with a scalar value head.

It reads the prompt only, takes the hidden state of the last prompt token, maps it to one logit with a linear head,
and is trained with BCE against the rollouts' binary rewards, so sigma(logit) estimates V(x) = E_y[R(x, y)]. It is
an analysis baseline for `poise-trl probe-bench` and never feeds POISE's advantages. Plain torch, so the same code
runs on the CPU for the tiny model and on a GPU for a 4B backbone.
"""

import math
from pathlib import Path

import torch
from torch import nn


class PromptCritic(nn.Module):
    """Backbone (a transformers base model returning `last_hidden_state`) + linear head on the last prompt token.

    The head starts at zero weight with its bias at logit(`init_value`), so training starts from the mean-value
    predictor instead of a random one: with few prompts, a random head would otherwise dominate the comparison.
    """

    def __init__(self, backbone: nn.Module, hidden_size: int, init_value: float = 0.5):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        p = min(max(init_value, 1e-3), 1 - 1e-3)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.fill_(math.log(p / (1 - p)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) value logits; works for left- and right-padded prompts alike."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.size(1) - 1 - attention_mask.flip(1).float().argmax(dim=1)
        pooled = hidden[torch.arange(hidden.size(0), device=hidden.device), last]
        return self.head(pooled.float()).squeeze(-1)


def load_critic(
    model_name_or_path: str | Path, device: str | torch.device = "cpu", init_value: float = 0.5
) -> PromptCritic:
    """A fresh critic initialised from the policy checkpoint (bf16 backbone on CUDA, fp32 on the CPU)."""
    from transformers import AutoModel

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backbone = AutoModel.from_pretrained(model_name_or_path, dtype=dtype)
    hidden_size = backbone.config.get_text_config().hidden_size
    return PromptCritic(backbone, hidden_size, init_value).to(device)


def _trimmed(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows: torch.Tensor, device: torch.device):
    """The rows' prompts without the columns that are padding in every row (prompts are stored padded globally)."""
    ids, mask = prompt_ids[rows], prompt_mask[rows]
    used = mask.bool().any(0).nonzero().flatten()
    columns = slice(int(used.min()), int(used.max()) + 1)
    return ids[:, columns].to(device), mask[:, columns].to(device)


def default_critic_lr(critic: PromptCritic) -> float:
    """1e-5 for real backbones (a common PPO critic rate), 3e-4 for toy models that 1e-5 would barely move."""
    return 1e-5 if sum(p.numel() for p in critic.backbone.parameters()) > 100_000_000 else 3e-4


def train_critic(
    critic: PromptCritic,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    targets: torch.Tensor,
    epochs: int = 10,
    lr: float | None = None,
    batch_size: int = 16,
    validation_fraction: float = 0.1,
    patience: int = 2,
    seed: int = 0,
) -> dict[str, list[float]]:
    """Fit with `BCEWithLogitsLoss` on per-prompt targets in [0, 1] and keep the epoch with the best validation loss.

    A prompt's target is the mean of its rollouts' rewards: BCE against that soft target equals the mean BCE over
    the individual binary rewards up to a constant, so this is the paper's objective at 1/K of the forward passes.
    Early stopping on held-out training prompts gives the critic the same chance not to overfit as the MLP probes.
    Returns the per-epoch mean training and validation losses.
    """
    device = next(critic.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(targets.numel(), generator=generator)
    n_val = int(round(validation_fraction * targets.numel())) if targets.numel() >= 10 else 0
    val_rows, fit_rows = order[:n_val], order[n_val:]
    targets = targets.float().clamp(0.0, 1.0)
    optimizer = torch.optim.AdamW(critic.parameters(), lr=lr or default_critic_lr(critic), weight_decay=0.0)
    loss_fn = nn.BCEWithLogitsLoss()
    history: dict[str, list[float]] = {"train_loss": [], "val_loss": []}
    best, best_state, stale = math.inf, None, 0
    for _ in range(epochs):
        critic.train()
        losses = []
        for chunk in fit_rows[torch.randperm(fit_rows.numel(), generator=generator)].split(batch_size):
            ids, mask = _trimmed(prompt_ids, prompt_mask, chunk, device)
            loss = loss_fn(critic(ids, mask), targets[chunk].to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        history["train_loss"].append(sum(losses) / len(losses))
        if n_val == 0:
            continue
        logits = predict_critic(critic, prompt_ids[val_rows], prompt_mask[val_rows], batch_size, logits=True)
        val_loss = loss_fn(logits, targets[val_rows]).item()
        history["val_loss"].append(val_loss)
        if val_loss < best:
            best, stale = val_loss, 0
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in critic.state_dict().items()}
        else:
            stale += 1
            if stale >= patience:
                break
    if best_state is not None:
        critic.load_state_dict(best_state)
    critic.eval()
    return history


@torch.no_grad()
def predict_critic(
    critic: PromptCritic,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    batch_size: int = 16,
    logits: bool = False,
) -> torch.Tensor:
    """(P,) predicted values sigma(z) in [0, 1] on the CPU (or the raw logits z with `logits=True`)."""
    was_training = critic.training
    critic.eval()
    device = next(critic.parameters()).device
    out = []
    for chunk in torch.arange(prompt_ids.size(0)).split(batch_size):
        ids, mask = _trimmed(prompt_ids, prompt_mask, chunk, device)
        out.append(critic(ids, mask).float().cpu())
    critic.train(was_training)
    z = torch.cat(out)
    return z if logits else torch.sigmoid(z)
