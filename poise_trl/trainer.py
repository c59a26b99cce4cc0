"""`POISETrainer`: `GRPOTrainer` with POISE's cross-rollout internal-state baseline. TRL glue around `POISEEstimator`:
with its prompt-selection mixin (selection.py) and its checkpoints' files (resume.py), the only code that knows TRL
internals."""

import inspect
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
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import (
    get_config_model_id,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from .batch import DEFAULT_DOMAIN
from .buffer import ProbeBuffer, prompt_group_ids
from .capture import capture_pass
from .card import card_section
from .config import POISEConfig
from .contract import TESTED_TRL, ContractError
from .estimator import POISEEstimator, Rollouts
from .features import FeatureLayout, feature_spans, find_decoder_layers
from .heads import ValueHead
from .prefix import PrefixBatch
from .resume import (
    ESTIMATOR_FILE,
    ResumableSampler,
    load_estimator,
    load_generation_batch,
    newest_complete_checkpoint,
    save_generation_batch,
)
from .selection import ValueGuidedSelection
from .step import (
    ROW_KEY,
    GenerationStep,
    MicroBatch,
    check_whole_groups,
    concat_prefix,
    join_rows,
    take_rows,
    whole_groups,
)

logger = logging.getLogger(__name__)

# Output keys of `_generate_and_score_completions` that TRL's own log-prob pass takes as model inputs besides the
# token ids (pixel_values, image_grid_thw, num_images, token_type_ids, ...): POISE's feature pass forwards the same.
_PASS_ARGUMENTS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")
FORWARD_INPUT_KEYS = tuple(
    name
    for name in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    if name not in (*_PASS_ARGUMENTS, "compute_aux_loss")
)

if not Version(TESTED_TRL[0]) <= Version(trl.__version__) < Version(TESTED_TRL[1]) and not os.environ.get(
    "POISE_ALLOW_UNTESTED_TRL"
):
    raise ImportError(
        f"poise-trl is tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]} but trl {trl.__version__} is installed. "
        f"POISETrainer hooks GRPOTrainer internals that change between releases: install "
        f"'trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}', or set POISE_ALLOW_UNTESTED_TRL=1 at your own risk."
    )


class POISETrainer(GRPOTrainer, ValueGuidedSelection):
    """
    Trainer for POISE (Policy Optimization with Internal State Value Estimation, arXiv 2605.07579).

    What changes w.r.t. [`~trl.GRPOTrainer`]: only the advantage. GRPO's group-mean baseline is replaced by
    `b_i = mean_{j != i} g_f(φ_j)`, where φ_j are rollout j's pooled hidden states (one decoder layer, last n prompt
    and reasoning tokens) plus entropy statistics, read during a teacher-forced pass TRL runs anyway, and g_f is an
    online ridge probe fitted on earlier steps only. `A_i = r_i - b_i`, unscaled. Until `probe_warmup_steps` steps
    have been seen the baseline is the bootstrap (`probe_bootstrap`: the shrunk a + w * RLOO by default, the paper's
    RLOO mean of the other rollouts' rewards with "rloo"). Generation, rewards, the clipped loss, vLLM, PEFT,
    DeepSpeed/FSDP and logging are inherited unchanged. Everything POISE learns lives in `self.estimator`, a
    [`POISEEstimator`]; this class only feeds it TRL's batches. With `probe_granularity="prefix"` the same pass also
    yields a value V(x, y_<t) for every generated token (prefix.py), and once that probe is trusted the loss receives
    (B, T) advantages r - V(x, y_<t), which TRL's `_compute_loss` takes as they are.

    Which pass (step.py's capture routes): TRL's own no-grad old-log-prob pass when it runs one; otherwise, in TRL's
    default configuration, the loss's own forward of each micro-batch: every micro-batch of a generation batch is then
    trained with the weights that generated it, each holds whole groups, and its advantages are written before TRL's
    `_compute_loss` reads them, after the forward. A step then runs exactly GRPOTrainer's forwards. Where a group
    cannot sit in one micro-batch (or with `probe_capture="pass"`), POISE runs a no-grad pass of its own. One record
    (`step.GenerationStep`) carries a generation batch from its prompts to the estimator's observation.

    Overrides (all of them):
    - `_generate_and_score_completions`: choose prompts (`prompt_selection`), then after TRL scored the batch,
      replace its advantages by the estimator's (times the drawn prompts' importance weights, and
      `num_items_in_batch`, the token-count losses' normaliser, by the weighted count), log `poise/*`, and let the
      estimator learn (training only); on the loss route the advantages come from each micro-batch's forward and the
      batch is observed after its last;
    - `_get_per_token_logps_and_entropies`: hook the probe layer(s) during the pass the features come from;
    - `_compute_loss`: on the loss route, mark the micro-batch whose forward is captured, refusing one whose
      generation batch has ended (and, in evaluation, observe the batch after it); `training_step`: on the loss
      route, observe the batch after its last micro-batch's backward;
    - `_prepare_inputs`: a batch TRL has just split into micro-batches becomes `step.MicroBatch`es tied to its record,
      which refuse to hand the loss advantages not yet written; where TRL runs no log-prob pass and splits a batch
      into several, their rows are regrouped into whole groups in the order TRL's shuffle drew
      (`step.whole_groups`), whichever capture route;
    - `_calculate_rewards`: keep the gathered rewards; `_generate`: keep the tool/env mask, so features use only the
      tokens the policy generated;
    - `get_train_dataloader`, `_get_train_sampler`: with `prompt_selection`, draw `prompt_selection_oversample` times
      more candidate prompts through TRL's `RepeatSampler`; a resumed run sees the prompts of an uninterrupted one;
    - `_save_checkpoint`, `_load_optimizer_and_scheduler`: the estimator's one file travels with every checkpoint,
      and a checkpoint inside a generation batch keeps the batch's untrained slices, which TRL does not save;
    - `train`: `resume_from_checkpoint=True` takes the newest complete checkpoint, not a folder a killed save left;
      however a call ends (an interrupt included), its generation batch ends with it, TRL's buffer included, so the
      next `train()` or `evaluate()` starts clean; `evaluation_loop`: the same for an interrupted evaluation;
    - `create_model_card`: TRL's card plus how POISE was configured and its last probe diagnostics.

    Each relies only on behaviours of TRL named in `poise_trl.contract` (tested against the installed TRL in
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
        self._resuming = False  # `train` was asked to resume: the sampler must replay the uninterrupted run
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
            self.estimator.load(args.probe_init_path, warm_start=True, device=self.accelerator.device)
        self.feature_passes = 0  # teacher-forced passes POISE ran itself (0 when TRL's pass or the loss's serves)
        self._generation: GenerationStep | None = None  # the generation batch being made, until it is observed
        # TRL's row shuffle is replaced by a whole-group one where the loss route splits a batch into micro-batches
        self._shuffle_whole_groups = (
            not self._trl_runs_old_logps_pass() and args.steps_per_generation > 1 and self._groups_fit("train")
        )
        if args.probe_capture == "auto" and self._capture_route("train") == "own_pass":
            logger.warning(
                "POISE runs a no-grad forward pass of its own each generation batch: TRL runs no log-prob pass here, "
                f"and per_device_train_batch_size={args.per_device_train_batch_size} is not a multiple of "
                f"num_generations={self.num_generations}, so a prompt's rollouts cannot share the micro-batch whose "
                "loss forward would give their features. Make it a multiple to run no extra pass."
            )
        self._card_metrics: dict[str, float] = {}
        self._warned_unscorable = False
        self._check_prompt_selection()
        self._check_dataset_size()

    # --------------------------------------------------------------------------------------- estimator shortcuts
    @property
    def probes(self):
        """Domain -> `OnlineLearner` (probe, buffer, step counter); one entry, "default", without a domain column."""
        return self.estimator.probes_

    @property
    def probe_layers(self) -> list[int]:
        return list(self.estimator.layers)

    @property
    def probe_layer(self) -> int:
        """The decoder layer whose features the probes use now (fixed, or the latest automatic choice)."""
        return self.estimator.layer_

    @property
    def probe_steps(self) -> int:
        return self.estimator.steps_

    @property
    def reward_std(self):
        return self.estimator.reward_std_

    @property
    def bootstrap_pairs(self) -> dict[str, ProbeBuffer]:
        return self.estimator.bootstrap_pairs_

    def _single_probe(self):
        if self.args.probe_domain_column is not None:
            raise AttributeError(
                f"This run keeps one probe per value of {self.args.probe_domain_column!r}: use "
                "`trainer.probes[domain].probe`, `.buffer` and `.steps`."
            )
        return self.estimator.probes_.get(DEFAULT_DOMAIN) or self.estimator.new_probe(DEFAULT_DOMAIN)

    @property
    def value_probe(self) -> ValueHead:
        """The probe (value head, `probe_head`) of a single-domain run."""
        return self._single_probe().probe

    @property
    def probe_buffer(self) -> ProbeBuffer:
        """The buffer of a single-domain run: features are (N, len(probe_layers), D)."""
        return self._single_probe().buffer

    # ----------------------------------------------------------------------------------------------------- capture
    def _trl_runs_old_logps_pass(self) -> bool:
        """Whether GRPOTrainer computes `old_per_token_logps` while scoring (then POISE captures inside that pass).
        TRL keeps this condition inline; tests/test_trainer.py pins this copy to what TRL does."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _groups_fit(self, mode: str) -> bool:
        """Whether each micro-batch the loss sees holds whole groups (TRL's layout puts a process's groups
        consecutively when its batch is a multiple of G; `shuffle_groups` keeps them whole across micro-batches)."""
        if mode == "train":
            return self.args.per_device_train_batch_size % self.num_generations == 0
        return self.args.per_device_eval_batch_size % self.num_generations_eval == 0

    def _capture_route(self, mode: str) -> str:
        """Where this mode's features come from (step.py's `ROUTES`): TRL's pass when it runs one, else the loss's
        forward (`probe_capture="auto"`) where each micro-batch holds whole groups, else a pass of POISE's own."""
        if self._trl_runs_old_logps_pass():
            return "trl_pass"
        if self.args.probe_capture == "pass" or not self._groups_fit(mode):
            return "own_pass"
        return "loss"

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        """Hook the probe layer(s) in the one pass this generation batch's features come from: TRL's no-grad
        old-log-prob pass or POISE's own (while armed), or the loss's forward of a micro-batch (`_compute_loss`)."""
        step = self._generation
        if step is not None and step.micro_batch is not None:
            if step.mode == "train" and not torch.is_grad_enabled():
                raise ContractError(
                    "loss_forward",
                    "a no-grad pass ran inside `_compute_loss` before the loss's own forward (a reference pass?), "
                    "and POISE would have read its states as the policy's.",
                    "Set probe_capture='pass'.",
                )
            return self._capture_micro_batch(step, model, input_ids, attention_mask, logits_to_keep, **kwargs)
        if not (step is not None and step.armed and model is self.model and not torch.is_grad_enabled()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        step.armed = False
        prompt_mask, completion_mask = attention_mask[:, :-logits_to_keep], attention_mask[:, -logits_to_keep:]
        self._track_spans(step, prompt_mask, input_ids[:, -logits_to_keep:], completion_mask)
        kwargs["compute_entropy"] = True
        with self._capture(step.spans, step.tokens) as capture:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        step.add(torch.arange(input_ids.size(0)), *capture.result(entropies))
        return logps, entropies, aux

    def _capture_micro_batch(self, step: GenerationStep, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        """The loss route: the forward of one micro-batch, hooked; its advantages (from its own rows and the probe of
        earlier steps) written into the micro-batch before TRL's loss reads them. The batch is observed once its last
        micro-batch has run (`training_step`, `_compute_loss`)."""
        inputs, step.micro_batch = step.micro_batch, None
        check_whole_groups(inputs[ROW_KEY], step.rollouts.num_generations)
        rows = torch.tensor(inputs[ROW_KEY])
        spans = step.spans.rows(rows)
        with self._capture(spans, None if step.tokens is None else step.tokens.for_rows(rows)) as capture:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        with torch.no_grad():
            features, prefix = capture.result(entropies.detach())
            order = rows.argsort()  # the estimator reads consecutive groups: the rows in batch order
            result = self.estimator.advantages(
                features[order.to(features.device)],
                step.rollouts_of(rows[order]),
                prefix=None if prefix is None else concat_prefix([prefix], order),
            )
            advantages = result.advantages if result.token_advantages is None else result.token_advantages
            inputs["advantages"] = advantages[order.argsort().to(advantages.device)]
            inputs.written = True
            step.add(rows, features, prefix)
        return logps, entropies, aux

    def _capture(self, spans, tokens):
        """The capture of this generation batch's probe layer(s), for the passes inside the `with` block."""
        layers = find_decoder_layers(self.accelerator.unwrap_model(self.model))
        layout = FeatureLayout.from_config(self.args)
        return capture_pass([layers[i] for i in self.probe_layers], spans, layout, tokens)

    def _track_spans(self, step: GenerationStep, prompt_mask, completion_ids, completion_mask) -> None:
        """This process's feature spans and, for a per-token baseline, its token capture: which tokens it learns
        from are drawn from (seed, step) for the global batch, this process's rows sliced from it, so a resumed run
        and any number of processes draw the same."""
        generated = None
        if step.tool_mask is not None:  # right-pad TRL's per-row lists to the completion width, as TRL does
            generated = torch.ones_like(completion_mask)
            for row, mask in enumerate(step.tool_mask):
                mask = torch.as_tensor(mask, dtype=generated.dtype)[: generated.size(1)]
                generated[row, : mask.numel()] = mask
        step.spans = feature_spans(
            prompt_mask, completion_ids, completion_mask, self.args.probe_pool_tokens, self.marker_ids, generated
        )
        step.tokens = self.estimator.token_baseline_.capturer(
            prompt_mask,
            completion_mask,
            step.spans.completion_mask,
            self.args.probe_pool_tokens,
            torch.Generator().manual_seed(self.args.seed + 7919 * self.state.global_step),
            self.accelerator.process_index * completion_ids.size(0),
        )

    def _generate(self, prompts):
        """Keep the tool/env mask (tool results and `rollout_func`'s `env_mask` are 0), so that features use only the
        tokens the policy generated; the capture pass runs before TRL puts it in the output dict."""
        generated = super()._generate(prompts)
        self._generation.tool_mask = generated[2]
        return generated

    def _feature_pass(self, output: dict[str, Any], mode: str) -> None:
        """One no-grad teacher-forced pass with entropies, outside gradient checkpointing, when TRL ran none and the
        loss's forward cannot serve. It takes the multimodal inputs TRL's own log-prob pass takes (pixel_values,
        image_grid_thw, ...)."""
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        forward_inputs = {key: output[key] for key in FORWARD_INPUT_KEYS if key in output}
        self._generation.armed = True
        logits_to_keep = output["completion_ids"].size(1)
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            self._get_per_token_logps_and_entropies(
                self.model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **forward_inputs
            )
        self.feature_passes += 1

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._generation.rewards_per_func = rewards_per_func
        return rewards_per_func

    def _scalar_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """TRL's `sum_then_normalize` reward (inline in TRL; pinned by tests/test_trainer.py): the weighted sum of the
        functions' rewards, NaN where every function returned None."""
        rewards = (rewards_per_func * self.reward_weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        return torch.where(torch.isnan(rewards_per_func).all(1), torch.nan, rewards)

    # -------------------------------------------------------------------------------------------------- advantages
    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        if self._generation is not None:
            raise ContractError(
                "train_buffer",
                "a generation batch was made before every micro-batch of the previous one was trained.",
                "Set probe_capture='pass'.",
            )
        step = self._generation = GenerationStep(mode, self._capture_route(mode))
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
        if step.spans is None:  # no pass captured while TRL scored: the spans come from the batch's masks
            self._track_spans(step, output["prompt_mask"], output["completion_ids"], output["completion_mask"])
        if step.route == "own_pass":
            self._feature_pass(output, mode)
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
        if step.route == "loss" or (mode == "train" and self._shuffle_whole_groups):
            output[ROW_KEY] = list(range(len(inputs)))  # each row's place before TRL shuffles: see `_prepare_inputs`
        if step.route == "loss":  # each micro-batch's advantages are written by its own forward
            output["advantages"] = torch.full_like(output["advantages"], torch.nan)
            return output
        result = self._observe(step)
        rows = slice(step.offset, step.offset + step.rows)
        output["advantages"] = result.advantages[rows]
        if result.token_advantages is not None:  # (B, T): TRL's loss takes them as they are
            output["advantages"] = result.token_advantages[rows, : output["completion_ids"].size(1)]
        return output

    def _compute_loss(self, model, inputs):
        """On the loss route, hook the forward of a micro-batch whose advantages are still to be written (a micro-batch
        trained again, with `num_iterations` > 1, keeps those its first forward wrote); in evaluation, observe the
        batch once its one micro-batch has run."""
        step = self._generation
        capture = isinstance(inputs, MicroBatch) and not inputs.written
        if capture and inputs.step is not step:
            raise ContractError(
                "train_buffer",
                "the loss received a micro-batch whose generation batch had already ended, its advantages never "
                "written.",
            )
        if capture:
            step.micro_batch = inputs
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            if capture:
                step.micro_batch = None
        if step is not None and step.mode == "eval" and step.route == "loss" and step.complete:
            self._observe(step)
        return loss

    def training_step(self, model, inputs, num_items_in_batch):
        """On the loss route, observe the generation batch after its last micro-batch's backward: the estimator's
        refit then never holds its memory beside the forward's activations."""
        loss = super().training_step(model, inputs, num_items_in_batch)
        step = self._generation
        if step is not None and step.route == "loss" and step.complete:
            self._observe(step)
        return loss

    def _prepare_inputs(self, generation_batch):
        """TRL's. A batch of POISE's rows (`ROW_KEY`) that TRL has just made is then replaced, in TRL's buffer and in
        place, by `MicroBatch`es tied to its record, regrouped into whole groups where TRL split it into several
        (`_whole_group_micro_batches`): every micro-batch then holds whole groups for the loss route, and
        `probe_capture="pass"` trains on the same micro-batches (TRL contract 'train_buffer')."""
        inputs = super()._prepare_inputs(generation_batch)
        if ROW_KEY not in inputs or isinstance(inputs, MicroBatch):
            return inputs
        if not self.model.training:  # evaluation: the batch is its one micro-batch, never buffered
            return MicroBatch(inputs, self._generation)
        buffer = self._buffered_inputs
        position = next((i for i, part in enumerate(buffer) if part is inputs), None)
        if position is None:
            raise ContractError("train_buffer", "the micro-batch `_prepare_inputs` returned is not in its buffer.")
        parts = self._whole_group_micro_batches(buffer) if len(buffer) > 1 else buffer
        buffer[:] = [MicroBatch(part, self._generation) for part in parts]
        return buffer[position]

    def _whole_group_micro_batches(self, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """TRL's micro-batches of one generation batch with their rows regrouped so that each holds whole groups,
        the groups in the order TRL's shuffle drew (`step.whole_groups`), split as TRL splits them. Pixel values go
        per row and back with TRL's own helpers, as around TRL's shuffle."""
        batch = join_rows([split_pixel_values_by_grid(part) for part in parts])
        batch = take_rows(batch, whole_groups(torch.tensor(batch[ROW_KEY]), self.num_generations))
        return [unsplit_pixel_values_by_grid(part) for part in split_tensor_dict(batch, len(parts))]

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
            self._card_metrics = metrics
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
    def _check_dataset_size(self) -> None:
        """A map-style training set smaller than one generation batch makes TRL's sampler yield no batch at all, so
        `train()` would run 0 steps and save an untrained model without a word; a domain column with more values
        than `probe_max_domains` would fail mid-run, when the first value too many arrives."""
        dataset = self.train_dataset
        if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            return
        needed = self._get_train_sampler(dataset).batch_size
        if len(dataset) < needed:
            raise ValueError(
                f"The training set is too small: it has {len(dataset)} prompts, but one generation batch needs "
                f"{needed} distinct prompts (generation_batch_size {self.args.generation_batch_size} / num_generations"
                f" {self.num_generations}"
                + (", times prompt_selection_oversample" if self.args.prompt_selection else "")
                + "), so training would run 0 steps. Lower per_device_train_batch_size, steps_per_generation or "
                "gradient_accumulation_steps, raise num_generations, or add data."
            )
        column = self.args.probe_domain_column
        if column is not None and column in getattr(dataset, "column_names", []):
            values = set(map(str, dataset[column]))
            if len(values) > self.args.probe_max_domains:
                raise ValueError(
                    f"probe_domain_column={column!r} has {len(values)} distinct values, more than probe_max_domains="
                    f"{self.args.probe_max_domains}: each domain keeps its own probe and buffer on the accelerator. "
                    "Map the column to fewer values, or raise probe_max_domains if the memory allows."
                )

    # -------------------------------------------------------------------------------------------------- files
    def save_probe(self, path: str | os.PathLike, include_buffer: bool = True) -> None:
        """Write the estimator (every domain's probe and buffer, the bootstrap, the reward std) to one safetensors
        file, atomically and without pickle. `probe_init_path` warm-starts a new run from it."""
        if self.accelerator.is_main_process:
            self.estimator.save(path, include_buffer=include_buffer)

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
        # Written first and atomically: once transformers writes trainer_state.json, POISE's files are complete.
        folder = Path(self._get_output_dir(trial=trial)) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            self.estimator.save(folder / ESTIMATOR_FILE)
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
        """TRL's card, plus a "POISE" section: how the value baseline was configured and how well it predicted."""
        super().create_model_card(model_name=model_name, dataset_name=dataset_name, tags=tags)
        if not self.is_world_process_zero():
            return
        path = Path(self.args.output_dir) / "README.md"
        card = ModelCard.load(path)
        section = card_section(
            self.args, self.probe_layer, self.probe_layers, self._card_metrics, self.state.global_step
        )
        marker = "### Framework versions"
        card.text = card.text.replace(marker, section + "\n" + marker) if marker in card.text else card.text + section
        card.save(path)
