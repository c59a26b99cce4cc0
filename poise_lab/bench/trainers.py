"""The trainers `poise-trl bench efficiency` races: TRL's and POISE's, with compute accounting, DAPO-DS, and the
peers a TRL user would pick instead: TRL's A*-PO and C-GRPO (the `trl-cgrpo` package).

Each is its library trainer, unmodified, plus mixins that count what a run spends and trains on; DAPO's dynamic
sampling is a benchmark-only `GRPOTrainer` subclass, not a library feature.
"""

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

from poise_trl.grpo.config import POISEConfig
from poise_trl.grpo.trainer import POISETrainer

from .common import COUNTERS
from .contenders import Contender

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # A*-PO lives in trl.experimental: its import warns
from trl.experimental.a2po import A2POConfig, A2POTrainer  # noqa: E402

try:  # C-GRPO is a PyPI package pinning trl<1.15; installed with --no-deps, it runs under TRL 1.16 (README)
    from trl_cgrpo import CGRPOConfig, CGRPOTrainer
except ImportError:
    CGRPOConfig = CGRPOTrainer = None

CGRPO_INSTALL = "pip install --no-deps trl-cgrpo==0.2.0"


class _Counted:
    """Holds `bench_counts`, what every benchmark trainer fills, and adds one generation call's spend to it."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bench_counts = dict.fromkeys(COUNTERS, 0)

    def _count_generation(self, completions: int, tokens: int, prefill: int) -> None:
        counts = self.bench_counts
        counts["completions_generated"] += completions
        counts["tokens_generated"] += tokens
        counts["prefill_tokens"] += prefill


class _PassAccounting(_Counted):
    """Rows per teacher-forced pass of a `GRPOTrainer` (the training pass, TRL's old-log-prob pass, POISE's own
    feature pass)."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        if self.model.training:
            self.bench_counts["forward_rows"] += int(input_ids.size(0))
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


class _Accounting(_PassAccounting):
    """Counts compute as it is spent: completions and tokens per generation call, rows per teacher-forced pass.

    `forward_rows` is the number of sequences sent through the policy in teacher-forced passes (the training pass,
    TRL's old-log-prob pass, POISE's own feature pass); generation is counted as completions and tokens. It sits
    innermost, so each of DAPO-DS's extra generation rounds is counted too. Prefill tokens are the prompt tokens each
    generated completion is conditioned on (HF generate prefills every repeated prompt), plus what value-guided
    selection spends (`poise/selection/prefill_tokens`, added from the log afterwards).
    """

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            gather = self.accelerator.gather
            self._count_generation(
                int(gather(output["completion_mask"]).size(0)),
                int(gather(output["completion_mask"].sum()).sum()),
                int(gather(output["prompt_mask"].sum()).sum()),
            )
        return output


class _TrainedAccounting:
    """Outermost: what is actually trained on, and `frac_zero_advantage_prompts`, the prompts whose completions all
    got advantage 0 and so teach nothing.

    For GRPO and RLOO that equals TRL's `frac_reward_zero_std` (degenerate groups); for POISE, degenerate groups
    still get `r - b != 0` once the probe is trusted, which is the point of the method; DAPO-DS trains on none.
    """

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        advantages = output["advantages"]  # (B,), or (B, T) token advantages (probe_granularity="prefix")
        if advantages.ndim == 2:  # completion widths differ across processes
            advantages = self.accelerator.pad_across_processes(advantages, dim=1)
        advantages = self.accelerator.gather(advantages)  # rank-major: groups are consecutive
        rows = (advantages.abs() < 1e-8).view(advantages.size(0), -1).all(1)  # a row teaches nothing
        zero = rows.view(-1, group).all(1)
        self._metrics[mode]["frac_zero_advantage_prompts"].append(zero.float().mean().item())
        if mode == "train":  # C-GRPO's padding rows (completion mask all 0) are not trained on
            trained = self.accelerator.gather(output["completion_mask"].any(1))
            self.bench_counts["completions_trained"] += int(trained.sum())
        return output


# Row tensors of `_generate_and_score_completions`' output and how DynamicSampling pads them to a common width.
_LEFT_PADDED = {"prompt_ids": "pad", "prompt_mask": 0}
_RIGHT_PADDED = {
    "completion_ids": "pad",
    "completion_mask": 0,
    "old_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
    "tool_mask": 1,
}


class DynamicSampling:
    """DAPO's dynamic sampling (Yu et al., 2025, §3.2) on top of GRPOTrainer, for the benchmark only.

    A group whose rewards all tie has zero advantage and teaches nothing. DAPO keeps generating until the step holds
    B/G informative groups: the sampler's prompts first, then fresh batches of B/G prompts drawn from the training set
    (seeded, its own order), keeping each batch's informative groups in order; at most `dapo_max_rounds` generation
    batches per step (a step that hits the cap trains on what it has, topped up with tied groups, and logs
    `dapo/capped`). Every completion generated is counted (`_Accounting`), the surplus of the last round included.

    DAPO's recipe drops the surplus informative groups of a step's last round. With `dapo_carry` they are kept and
    trained on first at the next step (one step off-policy, with their own group's advantages; TRL runs no
    old-log-prob pass here, so their ratio is taken against the current policy), so only tied groups are ever
    discarded: the strongest dynamic sampling, beyond DAPO's own recipe. The sampler's batch is still generated every
    step, so prompts keep flowing in the sampler's order.

    It overrides only `_generate_and_score_completions`, calling GRPOTrainer's once per round and concatenating the
    kept rows (prompts left-padded, completions right-padded to the widest round), so TRL's shuffling, buffering and
    loss run unchanged. A tie is read off the advantages: GRPO's `r - mean` is exactly 0 for every member of a tied
    group and for no group with two different rewards. Single process (every benchmark run is one).
    """

    dapo_max_rounds: int = 8
    dapo_carry: bool = False  # keep the last round's surplus informative groups for the next step

    def _generate_and_score_completions(self, inputs):
        if not self.model.training:
            return super()._generate_and_score_completions(inputs)
        if self.accelerator.num_processes != 1:
            raise RuntimeError("the benchmark's DynamicSampling runs in a single process")
        group = self.num_generations
        wanted = len(inputs) // group
        kept: list[tuple[dict[str, Any], torch.Tensor]] = []  # (round output, its kept group indices)
        tied: list[tuple[dict[str, Any], torch.Tensor]] = []
        carried = getattr(self, "_dapo_carried", [])  # surplus of the previous step's last round (<= wanted)
        kept.extend(carried)
        found, rounds, batch = sum(groups.numel() for _, groups in carried), 0, inputs
        self._dapo_carried = []
        while rounds == 0 or (found < wanted and rounds < self.dapo_max_rounds):
            output = super()._generate_and_score_completions(batch)
            rounds += 1
            mask = (output["advantages"].view(-1, group) != 0).any(1)
            informative = mask.nonzero().flatten()
            take = informative[: wanted - found]
            kept.append((output, take))
            tied.append((output, (~mask).nonzero().flatten()))
            found += take.numel()
            if self.dapo_carry and informative.numel() > take.numel():
                self._dapo_carried = [(output, informative[take.numel() :])]
            if found < wanted:
                batch = [row for row in self._fresh_prompts(wanted) for _ in range(group)]
        capped = found < wanted
        for output, groups in tied:  # only when capped: fill the step with tied groups (advantage 0, no signal)
            if found == wanted:
                break
            groups = groups[: wanted - found]
            kept.append((output, groups))
            found += groups.numel()
        self._metrics["train"]["dapo/rounds"].append(float(rounds))
        self._metrics["train"]["dapo/capped"].append(float(capped))
        self._metrics["train"]["dapo/carried"].append(float(sum(groups.numel() for _, groups in carried)))
        return self._concatenate(kept, group)

    def _fresh_prompts(self, count: int) -> list[dict[str, Any]]:
        """The next `count` training rows of the trainer's own seeded shuffle of the training set (cycled)."""
        if not hasattr(self, "_fresh_order"):
            self._fresh_generator = torch.Generator().manual_seed(self.args.seed + 1)
            self._fresh_order: list[int] = []
        rows = []
        for _ in range(count):
            if not self._fresh_order:
                n = len(self.train_dataset)
                self._fresh_order = torch.randperm(n, generator=self._fresh_generator).tolist()
            rows.append(self.train_dataset[self._fresh_order.pop()])
        return rows

    def _concatenate(self, parts: list[tuple[dict[str, Any], torch.Tensor]], group: int) -> dict[str, Any]:
        """The kept groups' rows of every round as one output dict, padded to common widths."""
        pad_id = self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else 0
        pieces: dict[str, list[torch.Tensor]] = {}
        for output, groups in parts:
            rows = (groups.unsqueeze(1) * group + torch.arange(group, device=groups.device)).flatten()
            for key, value in output.items():
                if key == "num_items_in_batch" or value is None:
                    continue
                if key not in _LEFT_PADDED and key not in _RIGHT_PADDED and key != "advantages":
                    raise NotImplementedError(f"DynamicSampling cannot concatenate {key!r} (multimodal/tools)")
                pieces.setdefault(key, []).append(value[rows.to(value.device)])
        merged: dict[str, Any] = {}
        for key, values in pieces.items():
            if key == "advantages":
                merged[key] = torch.cat(values)
                continue
            side, fill = ("left", _LEFT_PADDED[key]) if key in _LEFT_PADDED else ("right", _RIGHT_PADDED[key])
            fill = pad_id if fill == "pad" else fill
            width = max(v.size(1) for v in values)
            padded = []
            for v in values:
                extra = v.new_full((v.size(0), width - v.size(1)), fill)
                padded.append(torch.cat([extra, v] if side == "left" else [v, extra], dim=1))
            merged[key] = torch.cat(padded)
        merged["num_items_in_batch"] = (merged["completion_mask"] * merged.get("tool_mask", 1)).sum()
        return merged


class _BenchPOISETrainer(_TrainedAccounting, _Accounting, POISETrainer):
    pass


class _BenchGRPOTrainer(_TrainedAccounting, _Accounting, GRPOTrainer):
    pass


class _BenchRLOOTrainer(_TrainedAccounting, _Accounting, RLOOTrainer):
    pass


class _BenchDAPOTrainer(_TrainedAccounting, DynamicSampling, _Accounting, GRPOTrainer):
    pass


class _BenchDAPOCarryTrainer(_BenchDAPOTrainer):
    dapo_carry = True


class _BenchA2POTrainer(_Counted, A2POTrainer):
    """A*-PO with its spend counted: Stage 1's `num_value_samples` reference completions per training prompt (drawn
    before the first step, so a run's curve starts that many completions in), then one completion per prompt a step,
    and the two teacher-forced passes (reference and policy) of each training row."""

    def _estimate_optimal_values(self):
        generate = self.ref_model.generate

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            sequences = generate(*args, **kwargs)
            prompt = kwargs["attention_mask"]
            repeats = sequences.size(0) // prompt.size(0)  # num_return_sequences
            tokens = _tokens_to_eos(sequences[:, prompt.size(1) :], self.eos_token_ids)
            self._count_generation(sequences.size(0), tokens, int(prompt.sum()) * repeats)
            return sequences

        self.ref_model.generate = counted  # an instance attribute shadows the method while Stage 1 runs
        try:
            super()._estimate_optimal_values()
        finally:
            del self.ref_model.generate
        if len(self.train_dataset) == 0:
            raise SystemExit(
                "A*-PO dropped every training prompt: all of each one's reference samples failed "
                "(filter_all_incorrect). The starting model solves nothing here: warm it up longer (--warmup-steps)"
            )

    def _prepare_inputs(self, inputs):
        prepared = super()._prepare_inputs(inputs)
        if self.model.training:
            mask, completion = prepared["attention_mask"], prepared["logits_to_keep"]
            rows = mask.size(0)
            self._count_generation(rows, int(mask[:, -completion:].sum()), int(mask[:, :-completion].sum()))
            self.bench_counts["completions_trained"] += rows
        return prepared

    def _get_sequence_logps(self, model, input_ids, *args, **kwargs):
        if self.model.training:
            self.bench_counts["forward_rows"] += int(input_ids.size(0))
        return super()._get_sequence_logps(model, input_ids, *args, **kwargs)


def _tokens_to_eos(completions: torch.Tensor, eos_token_ids: list[int]) -> int:
    """Tokens generated per row up to and including its first EOS (all of a row without one), summed."""
    is_eos = torch.isin(completions, torch.tensor(eos_token_ids, device=completions.device))
    before_first_eos = is_eos.int().cumsum(1) - is_eos.int() == 0
    return int(before_first_eos.sum())


TRAINERS: dict[str, tuple[type, type]] = {
    "poise": (_BenchPOISETrainer, POISEConfig),
    "grpo": (_BenchGRPOTrainer, GRPOConfig),
    "rloo": (_BenchRLOOTrainer, RLOOConfig),
    "dapo_ds": (_BenchDAPOTrainer, GRPOConfig),
    "dapo_ds_carry": (_BenchDAPOCarryTrainer, GRPOConfig),
    "a2po": (_BenchA2POTrainer, A2POConfig),
}
if CGRPOTrainer is not None:

    class _BenchCGRPOTrainer(_TrainedAccounting, _PassAccounting, CGRPOTrainer):
        """C-GRPO with its spend counted where it generates: every budget increment and every calibration goes
        through `_base_generate`, so each completion is counted once; the one-token rows that pad a stopped prompt
        up to the group width are never generated and not counted (nor, masked out, trained on)."""

        def _base_generate(self, prompt_ids, *args, **kwargs):
            completion_ids, logprobs = super()._base_generate(prompt_ids, *args, **kwargs)
            if self.model.training:
                tokens = sum(len(ids) for ids in completion_ids)  # TRL cuts each completion after its first EOS
                self._count_generation(len(completion_ids), tokens, sum(len(ids) for ids in prompt_ids))
            return completion_ids, logprobs

    TRAINERS["cgrpo"] = (_BenchCGRPOTrainer, CGRPOConfig)

# A*-PO's training prompts: Stage 1 draws `num_value_samples` completions for each before the first step, so on a
# budget of completions the prompt count sets the split between the offline and the online stage. Half the budget
# offline (budget / (2 x num_value_samples) prompts: 200 at the study's 3,200 with A*-PO's default 8) leaves 50
# online steps of 32, each prompt visited 8 times: the paper's shape (V* estimated once, then several epochs).
A2PO_OFFLINE_SHARE = 0.5


def trainer_inputs(
    trainer: str, config: Any, budget: int, train: Dataset, extract_answer: Callable[[str], str | None] | None
) -> dict[str, Any]:
    """The data a contender's trainer is built with: the training split for the group methods; A*-PO's prompt subset
    (A2PO_OFFLINE_SHARE); C-GRPO's training prompts, its `num_calibration_samples` calibration prompts (the tail of
    the training split, held out of its training prompts) and the task's own answer parsing as its
    `answer_extractor`."""
    if trainer == "a2po":
        prompts = max(1, int(A2PO_OFFLINE_SHARE * budget) // config.num_value_samples)
        return {"train_dataset": train.select(range(min(prompts, len(train))))}
    if trainer == "cgrpo":
        if extract_answer is None:
            raise SystemExit("C-GRPO needs the task's answer parsing (its answer_extractor): this task has none")
        split = len(train) - config.num_calibration_samples
        return {
            "train_dataset": train.select(range(split)),
            "calibration_dataset": train.select(range(split, len(train))),
            "answer_extractor": extract_answer,
        }
    return {"train_dataset": train}


def unavailable_reason(contender: Contender) -> str | None:
    """Why a contender cannot run here (its package is not installed, or a config field it needs is missing in this
    library version), else None."""
    if contender.trainer == "cgrpo" and "cgrpo" not in TRAINERS:
        return f"trl-cgrpo is not installed ({CGRPO_INSTALL})"
    fields = {f.name for f in dataclasses.fields(TRAINERS[contender.trainer][1])}
    missing = sorted(set(contender.overrides) - fields)
    if missing:
        return f"{TRAINERS[contender.trainer][1].__name__} has no field {', '.join(missing)} (added by issue 12)"
    return None
