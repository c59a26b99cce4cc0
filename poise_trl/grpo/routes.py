"""The capture routes: the part of `POISETrainer` that reads a generation batch's features from the pass its route
names (step.py's `ROUTES`: TRL's old-log-prob pass, a pass of POISE's own, or the loss's forward of each
micro-batch) and hands them to the batch's record, `step.GenerationStep`.

Kept beside trainer.py (and mixed into `POISETrainer` only, ahead of `GRPOTrainer`, so that its overrides are the
trainer's) as `selection.py` is: like trainer.py it knows TRL internals, and only trainer.py imports it.
A batch takes TRL's pass when TRL runs one (`_trl_runs_old_logps_pass`), else the loss's forward where each
micro-batch can hold whole groups (`probe_capture="auto"`), else a pass of its own (`_capture_route`). Where TRL runs
no pass and splits a batch into several micro-batches, their rows are regrouped into whole groups in the order TRL's
shuffle drew (`step.whole_groups`), whichever route.
"""

import inspect
from typing import Any

import torch
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import split_pixel_values_by_grid, split_tensor_dict, unsplit_pixel_values_by_grid

from ..features.capture import capture_pass
from ..features.features import FeatureLayout, feature_spans, find_decoder_layers
from .contract import ContractError
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

# Keyword parameters of `_get_per_token_logps_and_entropies` that TRL's own log-prob pass fills from the output of
# `_generate_and_score_completions` besides the token ids (pixel_values, image_grid_thw, num_images,
# token_type_ids, ...): POISE's own pass forwards the same.
_PASS_ARGUMENTS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")
FORWARD_INPUT_KEYS = tuple(
    name
    for name in inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    if name not in (*_PASS_ARGUMENTS, "compute_aux_loss")
)


class CaptureRoutes:
    """Mixin for `POISETrainer` (which provides `estimator`, `args`, `marker_ids`, the record `_generation`, its
    `_observe` and TRL's methods)."""

    # ------------------------------------------------------------------------------------------------ the route
    def _trl_runs_old_logps_pass(self) -> bool:
        """Whether GRPOTrainer computes `old_per_token_logps` while scoring (then POISE captures inside that pass).
        TRL keeps this condition inline; contract 'old_logps_pass' pins this copy to what TRL does."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _groups_fit(self, mode: str) -> bool:
        """Whether each micro-batch the loss sees holds whole groups (TRL's layout puts a process's groups
        consecutively when its batch is a multiple of G; the regrouping keeps them whole across micro-batches)."""
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

    def _regroups(self, mode: str) -> bool:
        """Whether TRL's micro-batches of this mode's generation batches are regrouped into whole groups: in training
        without TRL's pass, where TRL splits a batch into several micro-batches and a group fits in one."""
        split = mode == "train" and self.args.steps_per_generation > 1
        return split and not self._trl_runs_old_logps_pass() and self._groups_fit(mode)

    def _start_generation(self, mode: str) -> GenerationStep:
        """The record of a generation batch TRL is about to make, on its route; refused while the previous batch
        has micro-batches left to train."""
        if self._generation is not None:
            raise ContractError(
                "train_buffer",
                "a generation batch was made before every micro-batch of the previous one was trained.",
                "Set probe_capture='pass'.",
            )
        self._generation = GenerationStep(mode, self._capture_route(mode), regroup=self._regroups(mode))
        return self._generation

    # --------------------------------------------------------------------------------------------- the passes
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
        return capture_pass([layers[i] for i in self.estimator.layers], spans, layout, tokens)

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
            prompt_mask,
            completion_ids,
            completion_mask,
            self.args.probe_pool_tokens,
            self.marker_ids,
            generated,
            self._tokenizer,
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

    def _capture_scored(self, step: GenerationStep, output: dict[str, Any]) -> None:
        """After TRL scored the batch: its spans from the batch's masks where no pass was captured while it scored,
        and, on the own-pass route, that pass."""
        if step.spans is None:
            self._track_spans(step, output["prompt_mask"], output["completion_ids"], output["completion_mask"])
        if step.route == "own_pass":
            self._feature_pass(output, step.mode)

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

    # ------------------------------------------------------------------------------------------- the loss route
    def _defer_to_loss(self, step: GenerationStep, output: dict[str, Any]) -> bool:
        """Mark each row's place before TRL shuffles (`ROW_KEY`) where the batch's micro-batches are regrouped or
        captured by the loss (`_prepare_inputs`); on the loss route, put NaN advantages in the batch, which its
        micro-batches' forwards replace, and say so (True)."""
        if step.route == "loss" or step.regroup:
            output[ROW_KEY] = list(range(step.rows))
        if step.route != "loss":
            return False
        output["advantages"] = torch.full_like(output["advantages"], torch.nan)
        return True

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
