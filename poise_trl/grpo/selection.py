"""Value-guided prompt selection (beyond the paper): the part of `POISETrainer` that draws prompts before TRL
generates.

Kept beside trainer.py (and mixed into `POISETrainer` only) so that the trainer stays TRL glue of one screenful per
concern; like trainer.py it knows TRL internals, and nothing else in the package imports it. The hook is the least
invasive one TRL allows: TRL's `RepeatSampler` draws `prompt_selection_oversample` times more prompts per generation
batch (the trainer's `_get_train_sampler`), each process receives its own shard of whole candidate groups as usual,
and `_select_prompts` keeps whole groups of its shard before TRL generates, so generation (vLLM included), rewards,
shuffling and the batch sizes TRL expects downstream are unchanged. Which groups is the sampling rule's (sampling.py),
from the estimator's predicted prompt values; the prediction costs one no-grad forward of the training model over the
candidates' prompt tokens. A rule's importance weights reach every row of a drawn group (`_row_weights`, gathered in
rank order like the rows) and multiply the advantages before TRL shuffles the batch.
"""

import json
import math

import torch
from datasets import IterableDataset
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import pad

from ..estimator.buffer import prompt_group_ids
from ..features.features import capture_layer, feature_spans, find_decoder_layers
from ..sampling import draw, rule_from_config
from .step import GenerationStep


class ValueGuidedSelection:
    """Mixin for `POISETrainer` (which provides `estimator`, `args` and TRL's methods)."""

    def _check_prompt_selection(self) -> None:
        if self.args.prompt_selection is None:
            return
        if self.environment_factories is not None or self._is_vlm:
            raise ValueError(
                f"prompt_selection={self.args.prompt_selection!r} predicts from a text-only prefill of the prompts, "
                "which environments and vision-language models change: set prompt_selection=None for this run."
            )
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(
                f"prompt_selection={self.args.prompt_selection!r} oversamples through TRL's RepeatSampler, which "
                "needs a map-style dataset: load the dataset without streaming, or set prompt_selection=None."
            )

    @property
    def selection_candidates(self) -> int:
        """Candidate prompts per process and generation batch: ceil(oversample x kept), raised until their rows fill
        `steps_per_generation` whole per-step batches, as TRL's dataloader needs."""
        rows = self.args.per_device_train_batch_size * self.args.steps_per_generation
        candidates = math.ceil(self.args.prompt_selection_oversample * rows / self.num_generations - 1e-9)
        while (candidates * self.num_generations) % self.args.steps_per_generation:
            candidates += 1
        return candidates

    def _prefill_prompts(self, prompts: list) -> tuple[torch.Tensor, int]:
        """Pooled last-n prompt states at the probe layer from one no-grad pass over the prompt tokens only (tokenized
        and left-padded by TRL's own `_tokenize_prompts` and `pad`), and the number of prompt tokens processed."""
        prompt_ids, _, _ = self._tokenize_prompts(prompts)
        device = self.accelerator.device
        rows = [torch.tensor(ids, device=device) for ids in prompt_ids]
        ids = pad(rows, padding_value=self._tokenizer.pad_token_id, padding_side="left")
        mask = pad([torch.ones_like(row) for row in rows], padding_value=0, padding_side="left")
        spans = feature_spans(mask, ids[:, :0], mask[:, :0], self.args.probe_pool_tokens, None)
        layer = find_decoder_layers(self.accelerator.unwrap_model(self.model))[self.estimator.layer_]
        with (
            torch.no_grad(),
            disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            capture_layer(layer, spans) as capture,
        ):
            self._get_per_token_logps_and_entropies(
                self.model, ids, mask, 1, batch_size=self.args.per_device_train_batch_size
            )
        return capture.pooled()[:, 0], sum(map(len, prompt_ids))

    def _select_prompts(self, inputs: list[dict], step: GenerationStep) -> list[dict]:
        """Keep `per_device_train_batch_size x steps_per_generation / G` whole groups of this process's candidates,
        drawn by the `prompt_selection` rule from the estimator's predicted prompt values (at random, seeded by
        (seed, rank, observed steps) so a resumed run draws the same, while the probe is not trusted); the kept rows'
        importance weights and the draw's figures go to the generation batch's record `step`."""
        if self.args.prompt_selection is None or not self.model.training:
            return inputs
        size = self.num_generations
        keep = self.args.per_device_train_batch_size * self.args.steps_per_generation // size
        groups = [inputs[i : i + size] for i in range(0, len(inputs), size)]
        keys = [[json.dumps(x["prompt"], sort_keys=True, default=str) for x in group] for group in groups]
        if len(inputs) % size or any(len(set(k)) != 1 for k in keys) or len(groups) < keep:
            raise RuntimeError(
                f"prompt_selection got {len(inputs)} rows that are not {keep} or more whole groups of {size} "
                "identical prompts: the sampler no longer yields TRL's layout."
            )
        values, reward_range, tokens = None, None, 0
        if self.estimator.trusted_:
            prompts = [group[0]["prompt"] for group in groups]
            states, tokens = self._prefill_prompts(prompts)
            # the candidates' history holds the steps observed so far: none of this step's rollouts
            values = self.estimator.prompt_values(states, prompt_group_ids(prompts).to(states.device))
            reward_range = None if values is None else self.estimator.target_range()
        drawn = draw(
            rule_from_config(self.args),
            len(groups),
            keep,
            values,
            reward_range,
            seed=self.args.seed,
            rank=self.accelerator.process_index,
            step=self.estimator.steps_,
        )
        weights = drawn.weights or [1.0] * len(drawn.indices)
        step.weights = torch.tensor(weights, dtype=torch.float64).repeat_interleave(size)
        variance = drawn.scores or [0.0] * len(groups)  # predicted reward variance q(1 - q) of each candidate
        step.selection = {
            "kept_fraction": keep / len(groups),
            "random": float(drawn.scores is None),
            "variance_kept": sum(variance[i] for i in drawn.indices),
            "variance_all": sum(variance),
            "groups_kept": float(keep),
            "groups_all": float(len(groups)),
            "prefill_tokens": float(tokens),
        }
        return [row for i in drawn.indices for row in groups[i]]

    def _row_weights(self, step: GenerationStep, rows: int) -> torch.Tensor | None:
        """Every process's kept rows' importance weights, gathered (rank-major, as the rows): (rows x processes,), or
        None when no prompts were drawn for the batch `step` (no selection, evaluation)."""
        weights = step.weights
        if weights is None:
            return None
        if len(weights) != rows:
            raise RuntimeError(f"prompt_selection drew {len(weights)} rows but the batch has {rows}.")
        return self.accelerator.gather(weights.to(self.accelerator.device))

    def _selection_metrics(
        self, step: GenerationStep, rewards: torch.Tensor, num_generations: int, weights: torch.Tensor | None
    ) -> dict[str, float]:
        """`selection/*` of the generation batch `step`, over all processes: kept fraction, mean predicted reward
        variance of kept and of all candidates, prefill tokens, the realized within-group reward variance and
        degenerate share, and the mean and largest importance weight of the kept prompts."""
        if self.args.prompt_selection is None or not step.selection:
            return {}
        s = step.selection
        keys = ("variance_kept", "groups_kept", "variance_all", "groups_all", "prefill_tokens")
        local = torch.tensor([s[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        grouped = rewards.view(-1, num_generations).double()
        complete = torch.isfinite(grouped).all(1)
        variance = torch.where(complete, torch.nan_to_num(grouped).var(1, unbiased=False), 0.0).sum()
        degenerate = torch.where(complete, grouped.amax(1) == grouped.amin(1), False).double().sum()
        realized = torch.stack([variance, degenerate]) / complete.sum()  # NaN when no group is complete
        weights = torch.ones_like(rewards, dtype=torch.float64) if weights is None else weights.double()
        realized = torch.cat([realized, torch.stack([weights.mean(), weights.max()]).to(realized.device)])
        total = self.accelerator.gather(local).view(-1, len(keys)).sum(0)
        names = keys + ("variance", "degenerate", "weight_mean", "weight_max")
        host = dict(zip(names, torch.cat([total, realized]).tolist(), strict=True))
        nan = math.nan
        return {
            "selection/kept_fraction": s["kept_fraction"],
            "selection/random": s["random"],
            "selection/predicted_spread": nan if s["random"] else host["variance_kept"] / host["groups_kept"],
            "selection/candidate_spread": nan if s["random"] else host["variance_all"] / host["groups_all"],
            "selection/prefill_tokens": host["prefill_tokens"],
            "selection/reward_variance": host["variance"],
            "selection/degenerate_fraction": host["degenerate"],
            "selection/weight_mean": host["weight_mean"],
            "selection/weight_max": host["weight_max"],
        }
