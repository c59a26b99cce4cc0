"""`POISETrainer`: `GRPOTrainer` with POISE's cross-rollout internal-state baseline. TRL glue around `POISEEstimator`:
with its capture routes (routes.py), its prompt selection (selection.py), the record of a generation batch (step.py)
and its checkpoints' files (resume.py), the only code that knows TRL internals."""

import logging
import math
import os
import textwrap
import warnings
from pathlib import Path
from typing import Any

import torch
import trl
from accelerate.utils import broadcast, gather_object
from datasets import IterableDataset
from huggingface_hub import ModelCard
from packaging.version import Version
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from ..estimator.buffer import prompt_group_ids
from ..estimator.estimator import POISEEstimator, Rollouts
from ..features.features import find_decoder_layers
from ..features.prefix import PrefixBatch
from .card import card_section
from .config import POISEConfig
from .contract import TESTED_TRL
from .resume import (
    ESTIMATOR_FILE,
    ResumableSampler,
    estimator_file,
    load_estimator,
    load_generation_batch,
    newest_complete_checkpoint,
    save_generation_batch,
)
from .routes import CaptureRoutes
from .selection import ValueGuidedSelection
from .step import GenerationStep
from .validation import REWARD_KEYWORDS, check_columns, check_dataset_size

logger = logging.getLogger(__name__)

if not Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1]) and not os.environ.get(
    "POISE_ALLOW_UNTESTED_TRL"
):
    raise ImportError(
        f"poise-trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]} but trl {trl.__version__} is installed. "
        f"POISETrainer hooks GRPOTrainer internals that change between releases: install "
        f"'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}', or set POISE_ALLOW_UNTESTED_TRL=1 at your own risk."
    )


class POISETrainer(CaptureRoutes, ValueGuidedSelection, GRPOTrainer):
    """
    Trainer for POISE (Policy Optimization with Internal State Value Estimation, arXiv 2605.07579).

    What changes w.r.t. [`~trl.GRPOTrainer`]: only the advantage. GRPO's group-mean baseline is replaced by
    `b_i = mean_{j != i} g_f(φ_j)`, where φ_j are rollout j's pooled hidden states (one decoder layer, last n prompt
    and reasoning tokens) plus entropy statistics, read during a teacher-forced pass TRL runs anyway, and g_f is an
    online ridge probe fitted on earlier steps only. `A_i = r_i - b_i`, unscaled. Until `probe_warmup_steps` steps
    have been seen the baseline is the bootstrap (`probe_bootstrap`: the shrunk a + w * RLOO by default, the paper's
    RLOO mean of the other rollouts' rewards with "rloo"). Generation, rewards, the clipped loss, vLLM, PEFT,
    DeepSpeed/FSDP and logging are inherited unchanged. Everything POISE learns lives in `trainer.estimator`, a
    [`POISEEstimator`] (its probes, buffers, layer, steps, reward statistics); this class only feeds it TRL's
    batches. With `probe_granularity="prefix"` the same pass also yields a value V(x, y_<t) for every generated token
    (prefix.py), and once that probe is trusted the loss receives (B, T) advantages r - V(x, y_<t), which TRL's
    `_compute_loss` takes as they are.

    Which pass (routes.py's capture routes): TRL's own no-grad old-log-prob pass when it runs one; otherwise, in TRL's
    default configuration, the loss's own forward of each micro-batch: every micro-batch of a generation batch is then
    trained with the weights that generated it, each holds whole groups, and its advantages are written before TRL's
    `_compute_loss` reads them, after the forward. A step then runs exactly GRPOTrainer's forwards. Where a group
    cannot sit in one micro-batch (or with `probe_capture="pass"`), POISE runs a no-grad pass of its own. One record
    (`step.GenerationStep`) carries a generation batch from its prompts to the estimator's observation.

    Overrides of TRL's methods (all of them; the capture routes' are in routes.py):
    - `_generate_and_score_completions`: choose prompts (`prompt_selection`), then after TRL scored the batch,
      replace its advantages by the estimator's (times the drawn prompts' importance weights, and
      `num_items_in_batch`, the token-count losses' normaliser, by the weighted count), log `poise/*`, and let the
      estimator learn (training only); on the loss route the advantages come from each micro-batch's forward and the
      batch is observed after its last;
    - `_calculate_rewards`: keep the gathered rewards in the batch's record;
    - routes.py: `_get_per_token_logps_and_entropies`: hook the probe layer(s) during the pass the features come
      from; `_generate`: keep the tool/env mask, so features use only the tokens the policy generated;
      `_compute_loss`: on the loss route, mark the micro-batch whose forward is captured, refusing one whose
      generation batch has ended (and, in evaluation, observe the batch after it); `training_step`: on the loss
      route, observe the batch after its last micro-batch's backward; `_prepare_inputs`: a batch TRL has just split
      into micro-batches becomes `step.MicroBatch`es tied to its record, which refuse to hand the loss advantages not
      yet written, regrouped into whole groups where TRL runs no log-prob pass and splits the batch into several;
    - `get_train_dataloader`, `_get_train_sampler`: with `prompt_selection`, draw `prompt_selection_oversample` times
      more candidate prompts through TRL's `RepeatSampler`; a resumed run sees the prompts of an uninterrupted one;
    - `save_model`: the estimator's one file beside the weights, in every saved, checkpointed or pushed model;
    - `_save_checkpoint`, `_load_optimizer_and_scheduler`: a checkpoint inside a generation batch keeps the batch's
      untrained slices, which TRL does not save; a resumed run restores them and the estimator;
    - `train`: `resume_from_checkpoint=True` takes the newest complete checkpoint, not a folder a killed save left;
      however a call ends (an interrupt included), its generation batch ends with it, TRL's buffer included, so the
      next `train()` or `evaluate()` starts clean; `evaluation_loop`: the same for an interrupted evaluation;
    - `create_model_card`: TRL's card plus how POISE was configured, its probe diagnostics over the last quarter of
      training and how to warm-start from the saved probe.
    The class attributes `_tag_names`, `_name` and `_paper` replace TRL's on the card.

    Each relies only on behaviours of TRL named in `poise_trl.grpo.contract` (tested against the installed TRL in
    tests/contract/); nothing of TRL's is patched.

    Value-guided prompt selection keeps whole groups of each process's candidates by a rule of sampling.py ("value":
    the highest predicted reward variance, biased; "importance": drawn with replacement in proportion to the predicted
    reward spread, with importance weights on the advantages and on the token-count normaliser, targeting the uniform
    objective; `POISEConfig` refuses the loss terms the weights cannot reach), at random until the probe is trusted;
    generation (vLLM included), rewards, shuffling and TRL's batch sizes downstream are unchanged.
    """

    _tag_names = ["trl", "poise"]
    _name = "POISE"
    _paper = {
        "title": "Your Language Model is Its Own Critic: Reinforcement Learning with Value Estimation from Actor's "
        "Internal States",
        "id": "2605.07579",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{choi2026poise,
                title        = {{Your Language Model is Its Own Critic: Reinforcement Learning with Value
                                 Estimation from Actor's Internal States}},
                author       = {Yunho Choi and Jongwon Lim and Woojin Ahn and Minjae Oh and Jeonghoon Shim
                                and Yohan Jo},
                year         = 2026,
                eprint       = {arXiv:2605.07579},
            }"""),
    }

    def __init__(self, model, reward_funcs=None, args: POISEConfig | GRPOConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = POISEConfig(f"{model_name.split('/')[-1]}-POISE")
        if isinstance(args, GRPOConfig) and not isinstance(args, POISEConfig):
            args = POISEConfig.from_grpo_config(args)  # a TRL script switches by changing the trainer class only
        if not isinstance(args, POISEConfig):
            raise TypeError(f"POISETrainer needs a POISEConfig or a GRPOConfig, got {type(args).__name__}.")
        # The run's, not a batch's: `train` was asked to resume, and the sampler transformers builds inside it must
        # replay the uninterrupted run.
        self._resuming = False
        super().__init__(model, reward_funcs, args=args, **kwargs)
        base = self.accelerator.unwrap_model(self.model)
        self.hidden_size = base.config.get_text_config().hidden_size
        self.marker_ids: list[int] | None = None
        if args.reasoning_end_marker is not None:
            self.marker_ids = self._tokenizer(args.reasoning_end_marker, add_special_tokens=False)["input_ids"]
            if not self.marker_ids:
                raise ValueError(f"reasoning_end_marker={args.reasoning_end_marker!r} tokenizes to no tokens.")
        self.estimator = POISEEstimator.from_config(
            args,
            len(find_decoder_layers(base)),
            self.hidden_size,
            broadcast=(lambda t: broadcast(t, from_process=0)) if self.accelerator.num_processes > 1 else None,
        )
        if args.probe_init_path is not None:
            self.estimator.load(estimator_file(args.probe_init_path), warm_start=True, device=self.accelerator.device)
        self.feature_passes = 0  # teacher-forced passes POISE ran itself (0 when TRL's pass or the loss's serves)
        # The record of the generation batch being made, until it is observed: TRL calls the overrides that fill it
        # one at a time, so each finds it here; None between batches.
        self._generation: GenerationStep | None = None
        if args.probe_capture == "auto" and self._capture_route("train") == "own_pass":
            logger.warning(
                "POISE runs a no-grad forward pass of its own each generation batch: TRL runs no log-prob pass here, "
                f"and per_device_train_batch_size={args.per_device_train_batch_size} is not a multiple of "
                f"num_generations={self.num_generations}, so a prompt's rollouts cannot share the micro-batch whose "
                "loss forward would give their features. Make it a multiple to run no extra pass."
            )
        self._warned_unscorable = False  # the run's, not a batch's: the warning comes once per trainer
        self._check_prompt_selection()
        self._check_datasets()

    # -------------------------------------------------------------------------------------------------- advantages
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._generation.rewards_per_func = rewards_per_func
        return rewards_per_func

    def _scalar_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """TRL's `sum_then_normalize` reward (inline in TRL; pinned by tests/test_trainer.py): the weighted sum of the
        functions' rewards, NaN where every function returned None."""
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        return torch.where(torch.isnan(rewards_per_func).all(1), torch.nan, rewards)

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        step = self._start_generation(mode)
        inputs = self._select_prompts(inputs, step)
        step.armed = step.route == "trl_pass"
        output = super()._generate_and_score_completions(inputs)
        step.armed = False
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        if num_generations < 2:  # eval with a single generation: nothing to pair, keep TRL's advantages
            rows = len(inputs) * self.accelerator.num_processes
            self._logs["extra"]["baseline"].extend([float("nan")] * rows)  # keep the column in step with its rows
            self._generation = None
            return output
        self._capture_scored(step, output)
        step.rows, step.offset = len(inputs), self.accelerator.process_index * len(inputs)
        weights = self._row_weights(step, len(inputs)) if mode == "train" else None  # the prompts' importance weights
        # Each row's prompt id: the K-fold groups of the layer choice and the prompt history's key. Environment-routed
        # datasets may have no `prompt` column; the row then names the prompt.
        device = self.accelerator.device
        step.rollouts = Rollouts(
            rewards=self._scalar_rewards(step.rewards_per_func),
            num_generations=num_generations,
            domains=self._domain_names(inputs, num_generations),
            has_completion=self.accelerator.gather(step.spans.completion_mask.any(1)),
            weights=weights,
            prompt_ids=self.accelerator.gather(prompt_group_ids([x.get("prompt", x) for x in inputs]).to(device)),
        )
        # dapo, cispo and vespo divide by TRL's token count: count each row's tokens as its advantages are weighted
        if weights is not None:
            output["num_items_in_batch"] = self._weighted_token_count(output, weights)
        if self._defer_to_loss(step, output):  # each micro-batch's advantages are written by its own forward
            return output
        result = self._observe(step)
        rows = slice(step.offset, step.offset + step.rows)
        output["advantages"] = result.advantages[rows]
        if result.token_advantages is not None:  # (B, T): TRL's loss takes them as they are
            output["advantages"] = result.token_advantages[rows, : output["completion_ids"].size(1)]
        return output

    def _observe(self, step: GenerationStep):
        """The generation batch's advantages from every process's features (one gather), the estimator's learning
        (training only), the step's one device->host transfer, and the `poise/*` logs; the batch's record ends."""
        self._generation = None
        local_features, local_prefix = step.assemble()
        features = self.accelerator.gather(local_features.to(self.accelerator.device))  # (N, len(probe_layers), D)
        prefix = None if local_prefix is None else self._gather_prefix(local_prefix)
        result = self.estimator.advantages(features, step.rollouts, prefix=prefix)
        rewards, num_generations = step.rollouts.rewards, step.rollouts.num_generations
        fit_metrics = {}
        if step.mode == "train":  # learn only after this batch's advantages were taken
            fit_metrics = self.estimator.observe(result)
        metrics = {**result.metrics(), **fit_metrics}  # the step's one device->host transfer (done by `observe`)
        advantages, baselines = result.logged_rows()
        logged = self._logs["advantages"]  # TRL logged its group-mean advantages for this batch: replace them
        for _ in range(min(len(advantages), len(logged))):
            logged.pop()
        logged.extend(advantages)
        self._logs["extra"]["baseline"].extend(baselines)
        if metrics["unscorable_rows"] == len(advantages) and not self._warned_unscorable:
            self._warned_unscorable = True
            warnings.warn(
                f"Every one of the {len(advantages)} completions of this step is unscorable (each reward function "
                "returned None or NaN): their advantages are 0 and the step teaches nothing. Check that the reward "
                "functions get the dataset columns they need. `poise/unscorable_rows` counts such rows per step.",
                stacklevel=2,
            )
        if step.mode == "train":
            metrics.update(self._selection_metrics(step, rewards, num_generations, step.rollouts.weights))
        for name, value in metrics.items():
            if not math.isnan(value):  # undefined (NaN) is left out: TRL would log None, which trackers drop
                self._metrics[step.mode][f"poise/{name}"].append(value)
        return result

    def _weighted_token_count(self, output: dict[str, Any], weights: torch.Tensor) -> torch.Tensor:
        """TRL's `num_items_in_batch` (the generation batch's loss tokens, gathered) with every row's tokens counted
        as its advantages are weighted, by `weights` (gathered, (N,)) rescaled to sum to N: the token-count losses'
        normaliser as an estimate of a uniform batch's count, like their numerator. The rescaling (a self-normalised,
        Hajek, estimate) cancels the weights' own fluctuation; both counts tend to the uniform one as the batch grows,
        and exact enumeration puts the self-normalised one nearer the uniform step at every batch size measured
        (docs/prompt-selection.md). Equal to TRL's count when every weight is 1."""
        mask = output["completion_mask"]
        if output.get("tool_mask") is not None:
            mask = mask * output["tool_mask"]
        tokens = self.accelerator.gather(mask.sum(1)).to(weights.dtype)
        weights = weights.to(tokens.device)
        return ((tokens * weights).sum() * weights.numel() / weights.sum()).float()

    def _gather_prefix(self, local: PrefixBatch) -> PrefixBatch:
        """The per-prefix capture of every process, token tensors padded to the widest completion."""
        pad = self.accelerator.pad_across_processes

        def gather(tensor: torch.Tensor | None, dim: int | None = None) -> torch.Tensor | None:
            if tensor is None:
                return None
            return self.accelerator.gather(tensor.to(self.accelerator.device) if dim is None else pad(tensor, dim))

        return PrefixBatch(
            rows=gather(local.rows),
            sampled=gather(local.sampled),
            values=gather(local.values, 1),
            generated=gather(local.generated, 1),
            tokens=gather(local.tokens),
        )

    def _domain_names(self, inputs: list[dict], num_generations: int) -> list[str] | None:
        """Each global row's domain (identical on every rank), or None without `probe_domain_column`."""
        column = self.args.probe_domain_column
        if column is None:
            return None
        if any(column not in x for x in inputs):
            raise ValueError(
                f"probe_domain_column={column!r}, but the batch has no such column (columns: {sorted(inputs[0])}). "
                "Add it to the dataset, or set probe_domain_column=None."
            )
        domains = [str(name) for name in gather_object([x[column] for x in inputs])]
        for start in range(0, len(domains), num_generations):
            group = domains[start : start + num_generations]
            if len(set(group)) != 1:
                raise ValueError(f"One prompt's rollouts carry different {column!r} values: {group}.")
        return domains

    # ------------------------------------------------------------------------------------------------ checks
    def _check_datasets(self) -> None:
        """The datasets' errors that would otherwise come at the first step, or never (validation.py)."""
        datasets = {"train_dataset": self.train_dataset}
        if isinstance(self.eval_dataset, dict):
            datasets.update({f"eval_dataset[{name!r}]": data for name, data in self.eval_dataset.items()})
        elif self.eval_dataset is not None:
            datasets["eval_dataset"] = self.eval_dataset
        functions = zip(self.reward_func_names, self.reward_funcs, strict=True)
        check_columns(
            datasets,
            {name: function for name, function in functions if not isinstance(function, torch.nn.Module)},
            prompt_required=self.environment_factories is None,
            domain_column=self.args.probe_domain_column,
            keywords=REWARD_KEYWORDS + (("environments",) if self.environment_factories is not None else ()),
        )
        if self.train_dataset is not None and not isinstance(self.train_dataset, IterableDataset):
            check_dataset_size(self.train_dataset, self._get_train_sampler(self.train_dataset).batch_size, self.args)

    # -------------------------------------------------------------------------------------------------- files
    def save_probe(self, path: str | os.PathLike, include_buffer: bool = True) -> None:
        """Write the estimator (every domain's probe and buffer, the bootstrap, the reward std) to one safetensors
        file, atomically and without pickle. `probe_init_path` warm-starts a new run from it. `save_model` writes the
        same file beside the weights."""
        if self.accelerator.is_main_process:
            self.estimator.save(path, include_buffer=include_buffer)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' save, with the estimator's file (`ESTIMATOR_FILE`, `save_probe`'s format) written first
        beside the weights by the processes that write them: a model saved, checkpointed or pushed to the Hub
        (`push_to_hub` saves through here) carries its probe, and `probe_init_path` takes the folder."""
        if self.args.should_save:  # atomically, so a checkpoint's file is whole before its trainer state exists
            self.estimator.save(Path(self.args.output_dir if output_dir is None else output_dir) / ESTIMATOR_FILE)
        super().save_model(output_dir, _internal_call)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """`resume_from_checkpoint=True` resumes from the newest *complete* checkpoint: transformers would take the
        newest folder, which a save killed midway leaves without its trainer state. However the call ends (an
        interrupt or an exception included), the generation batch it was training on ends with it
        (`_end_generation_batch`), so the next `train()` or `evaluate()` starts as a new trainer would."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = newest_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No complete checkpoint found in output directory ({self.args.output_dir}).")
        self._resuming = bool(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._end_generation_batch()

    def _end_generation_batch(self) -> None:
        """Drop the generation batch in training: its record and TRL's buffer of its micro-batches, which TRL keeps
        across `train()` calls (on the loss route without advantages, which only the ended record could write).
        TRL then generates the next batch and trains it from its first micro-batch (contract 'train_buffer')."""
        self._generation = None
        self._buffered_inputs, self._step = None, 0

    def evaluation_loop(self, *args, **kwargs):
        """An evaluation interrupted before its batch's loss ran leaves no record behind: the next evaluation or
        training generates afresh."""
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            if self._generation is not None and self._generation.mode == "eval":
                self._generation = None

    def get_train_dataloader(self):
        """TRL's dataloader, with per-process batches of `selection_candidates` whole groups under prompt_selection
        (TRL's map-style path, `_get_dataloader`, with that batch size; selection refuses iterable datasets)."""
        if self.args.prompt_selection is None:
            return super().get_train_dataloader()
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self.selection_candidates * self.num_generations,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_train_sampler(self, dataset=None):
        """TRL's `RepeatSampler`, drawing `selection_candidates` prompts per process under prompt_selection; in a
        resumed run, wrapped to replay the uninterrupted run's prompts (`ResumableSampler`)."""
        sampler = super()._get_train_sampler(dataset)
        if self.args.prompt_selection is not None:
            sampler.batch_size = self.selection_candidates * self.accelerator.num_processes
        return ResumableSampler(sampler, lambda: self.state) if self._resuming else sampler

    def _save_checkpoint(self, model, trial):
        if self._generation is not None:  # the loss route observes a batch before its optimizer step ends
            raise RuntimeError(
                "A checkpoint was asked for while a generation batch was still being captured: POISE keeps no "
                "features of its trained micro-batches in a checkpoint, which transformers saves only between "
                "optimizer steps (each of which ends a generation batch where TRL runs no log-prob pass)."
            )
        # The estimator's file comes with the weights (`save_model`), before transformers writes trainer_state.json.
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        # Inside a generation batch, TRL's slices still to train on live outside its checkpoint: keep each process's.
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._buffered_inputs is not None and self._step % generate_every:
            save_generation_batch(folder, self.accelerator.process_index, self._buffered_inputs, self._step)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        folder, device = Path(checkpoint), self.accelerator.device
        generation = load_generation_batch(folder, self.accelerator.process_index, device)
        if generation is not None:  # resume inside the generation batch, on the slices not yet trained on
            self._buffered_inputs, self._step = generation
        load_estimator(folder, self.estimator, device)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card, plus a "POISE" section: how the value baseline was configured, how well it predicted over the
        last quarter of training, and how to warm-start from the probe saved beside the weights."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = Path(self.args.output_dir) / "README.md"
        card = ModelCard.load(path)
        section = card_section(
            self.args,
            self.estimator.layer_,
            list(self.estimator.layers),
            self.state.log_history,
            self.state.global_step,
            ESTIMATOR_FILE,
            (path.parent / ESTIMATOR_FILE).exists(),
        )
        marker = "### Framework versions"
        card.text = card.text.replace(marker, section + "\n" + marker) if marker in card.text else card.text + section
        card.save(path)
