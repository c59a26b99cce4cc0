"""POISE in a plain PyTorch loop, no TRL trainer: the demo's tiny model learns to sort digits.

    python examples/custom_loop.py --steps 150

Each step samples 2 rollouts per prompt, scores them, runs one teacher-forced pass with a scoped hook on one decoder
layer (pooled hidden states of the last prompt and reasoning tokens, plus 3 entropy statistics), asks
`POISEEstimator` for the advantages, takes a policy-gradient step and lets the estimator learn from the batch. Any
loop (verl, OpenRLHF, your own) needs these same four calls; see docs/custom-loops.md.
"""

import argparse
import json
import random

import torch
from datasets import Dataset

from poise_lab.models.toy import default_cache_dir, evaluate_avg_at_k, load_demo_model, prepare_demo_model
from poise_lab.tasks.toy import MAX_COMPLETION_LENGTH, REASONING_END, make_sort_splits, task_reward
from poise_trl import EstimatorSpec, POISEEstimator, Rollouts
from poise_trl.estimator.specs import BufferSpec, HeadSpec
from poise_trl.features.features import (
    FeatureLayout,
    capture_layer,
    feature_spans,
    find_decoder_layers,
    resolve_layer_index,
)

LAYOUT, G, POOL = FeatureLayout(), 2, 10  # φ: the prompt and reasoning blocks, then the paper's 3 entropy statistics


def rollouts(model, tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """G sampled completions per prompt, the G of one prompt consecutive: (prompt ids, prompt mask, completion ids,
    completion mask up to and including EOS)."""
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        sequences = model.generate(
            **inputs, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=MAX_COMPLETION_LENGTH,
            num_return_sequences=G, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    width = inputs["input_ids"].size(1)
    completion = sequences[:, width:]
    eos = completion == tokenizer.eos_token_id
    completion_mask = (eos.cumsum(1) - eos.long()) == 0  # up to and including the first EOS
    return sequences[:, :width], inputs["attention_mask"].repeat_interleave(G, 0), completion, completion_mask.long()


def train(model_dir: str, train_set: Dataset, eval_set: Dataset, steps: int = 150, prompts_per_step: int = 32,
          lr: float = 1e-4, probe_warmup_steps: int = 16, seed: int = 0, eval_k: int = 4) -> dict:  # fmt: skip
    """RL on `train_set` (sort prompts with answers); held-out avg@k on `eval_set` before and after."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model, tokenizer = load_demo_model(model_dir)
    hidden, layers = model.config.hidden_size, find_decoder_layers(model)
    layer = layers[resolve_layer_index(None, len(layers))]  # about half-way down, the paper's choice
    marker = tokenizer.convert_tokens_to_ids(REASONING_END)
    head = HeadSpec(alpha=100.0, pca_dims=LAYOUT.pca_blocks(hidden, [32, 64], cap_at_width=True))  # the release's
    estimator = POISEEstimator(G, EstimatorSpec(head=head, buffer=BufferSpec(warmup_steps=probe_warmup_steps)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    before = evaluate_avg_at_k(model, tokenizer, eval_set, k=eval_k, seed=seed)["avg_at_k"]
    history = []
    for _ in range(steps):
        rows = [rng.randrange(len(train_set)) for _ in range(prompts_per_step)]
        batch = train_set.select(rows)
        model.eval()
        prompt_ids, prompt_mask, completion_ids, completion_mask = rollouts(model, tokenizer, list(batch["prompt"]))
        texts = tokenizer.batch_decode(completion_ids * completion_mask, skip_special_tokens=True)
        rewards = torch.tensor(task_reward(texts, [a for a in list(batch["answer"]) for _ in range(G)]))
        # Teacher-forced pass: the loss's log-probs, and the features from the hooked layer (detached).
        model.train()
        spans = feature_spans(prompt_mask, completion_ids, completion_mask, POOL, [marker])
        with capture_layer(layer, spans) as capture:
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids], 1),
                attention_mask=torch.cat([prompt_mask, completion_mask], 1),
            ).logits[:, prompt_ids.size(1) - 1 : -1]
        log_probs = logits.log_softmax(-1)
        token_log_probs = log_probs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        entropies = -(log_probs.exp() * log_probs).sum(-1).detach()
        features = LAYOUT.assemble(capture.pooled(), entropies, spans)
        groups = torch.tensor(rows).repeat_interleave(G)  # each row's prompt, for grouped cross-validation
        record = Rollouts(rewards, has_completion=completion_mask.any(1), prompt_ids=groups)
        result = estimator.advantages(features, record)
        mask = completion_mask.float()
        loss = -(result.advantages.unsqueeze(1) * token_log_probs * mask).sum() / mask.sum()  # token mean
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        estimator.observe(result)  # learns from the batch `advantages` prepared
        history.append(
            {"reward": rewards.mean().item(), "trusted": estimator.trusted_, **result.metrics(),
             "advantages": result.advantages.tolist(), "baselines": result.baselines.tolist(),
             "values": result.values.tolist()}
        )  # fmt: skip
    after = evaluate_avg_at_k(model, tokenizer, eval_set, k=eval_k, seed=seed)["avg_at_k"]
    return {"avg_at_k_before": before, "avg_at_k_after": after, "history": history, "estimator": estimator}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4, help="3e-4 collapses the tiny policy")
    parser.add_argument("--probe-warmup-steps", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache-dir", default=None, help="where the warm-started demo model is kept")
    args = parser.parse_args()
    model_dir = prepare_demo_model(args.cache_dir or default_cache_dir(), seed=args.seed)
    train_set, eval_set = make_sort_splits(seed=args.seed)  # the demo model's warm start never saw eval_set
    run = train(str(model_dir), train_set, eval_set.select(range(64)), args.steps, args.prompts_per_step, args.lr,
                args.probe_warmup_steps, args.seed)  # fmt: skip
    first, last = run["history"][:10], run["history"][-10:]
    print(json.dumps({
        "held-out avg@4 before": round(run["avg_at_k_before"], 3), "after": round(run["avg_at_k_after"], 3),
        "train reward (first 10 steps)": round(sum(h["reward"] for h in first) / len(first), 3),
        "train reward (last 10 steps)": round(sum(h["reward"] for h in last) / len(last), 3),
        "probe MAE (last 10 steps)": round(sum(h["mae"] for h in last) / len(last), 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
