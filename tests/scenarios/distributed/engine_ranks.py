"""Train POISE for 3 steps under the engine `accelerate launch` configured (DeepSpeed ZeRO-2/3, FSDP1/2), saving a
checkpoint at step 2, then resume a second trainer from it in the same processes; each rank dumps what it saw.

Recorded: the engine that really ran, the hooked layer's output at step 1 (before any update) next to an unsharded
fp32 copy's, the estimator's digest after every step, and what the resumed trainer loaded and computed.
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, DistributedType, PartialState
from datasets import Dataset
from rank_io import finish
from transformers import AutoModelForCausalLM

from poise_trl import POISEConfig, POISETrainer
from poise_trl.features.features import find_decoder_layers

MODEL, OUT, CAPTURE, ON_CPU = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "cpu"
# Loaded before any training argument exists: ZeRO-3 would otherwise partition it at load time too.
REFERENCE = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()


def keep_fsdp_on_cpu() -> None:
    """accelerate 1.15 turns an FSDP launch on CPU into plain DDP without a word (its state switches to FSDP only
    from GPU-like distributed types, never MULTI_CPU): keep the FSDP plugin it was given, so FSDP really runs."""
    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


def no_shared_memory_all_reduce() -> None:
    """DeepSpeed's first init on a CPU JIT-compiles its shared-memory all-reduce op (about 60 s of one core, again on
    every fresh machine) after probing a compiler for each of its ops. Only its inference tensor parallelism calls
    that op (`inference_all_reduce`); ZeRO training goes through torch.distributed (gloo here). Marked unavailable,
    as DeepSpeed itself marks it off Linux, so neither the probe nor the compile runs and the engine is the same."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def digest(trainer: POISETrainer) -> str:
    """The estimator's whole state (probes, buffers, bootstrap, counters) as one hash."""
    state = trainer.estimator.state_dict()
    h = hashlib.sha256(json.dumps(state["info"], sort_keys=True).encode())
    for name, tensor in sorted(state["tensors"].items()):
        h.update(name.encode() + tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def reward(completions: list[str], **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


class Recording(POISETrainer):
    """Records each step's estimator digest and advantages, and the hooked layer's raw output in step 1's capture
    (whichever pass it is: TRL's, POISE's own, or the loss's forward)."""

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kwargs):
        step = self._generation
        capturing = step is not None and (step.micro_batch is not None or step.armed and not torch.is_grad_enabled())
        if not (capturing and self.layer_outputs is None):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        layer = find_decoder_layers(self.accelerator.unwrap_model(self.model))[self.estimator.layer_]
        outputs = []  # a Qwen3 layer returns a tensor, other architectures a tuple
        handle = layer.register_forward_hook(lambda m, a, out: outputs.append(out if torch.is_tensor(out) else out[0]))
        try:
            result = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, **kwargs
            )
        finally:
            handle.remove()
        self.layer_outputs = (input_ids, attention_mask, torch.cat(outputs).detach())
        return result

    def _generate_and_score_completions(self, inputs):
        if self.held_weight is None:  # outside any forward, during training
            self.held_weight = held_weight(self)
        return super()._generate_and_score_completions(inputs)

    def _observe(self, step):
        result = super()._observe(step)
        rows = slice(step.offset, step.offset + step.rows)
        self.steps.append({"digest": digest(self), "advantages": result.advantages[rows].tolist()})
        return result

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.loaded = digest(self)


def trainer(output_dir: Path) -> Recording:
    args = POISEConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=1e-2,
        num_iterations=2 if CAPTURE == "trl-pass" else 1,  # 2: TRL runs its old-log-prob pass, POISE captures in it
        probe_capture="pass" if CAPTURE == "own-pass" else "auto",  # "loss": the loss's own forward
        probe_warmup_steps=1,
        probe_preset="paper",
        use_cpu=ON_CPU,  # on GPUs: NCCL, still fp32
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        disable_tqdm=True,
        seed=0,
    )
    dataset = Dataset.from_list([{"prompt": f"{i}+{(7 * i) % 13}="} for i in range(24)])
    recording = Recording(MODEL, reward, args=args, train_dataset=dataset)
    recording.steps, recording.layer_outputs, recording.loaded, recording.saves = [], None, None, 0
    recording.held_weight = None
    save = recording.estimator.save

    def counted_save(*args, **kwargs):
        recording.saves += 1
        return save(*args, **kwargs)

    recording.estimator.save = counted_save
    return recording


def layer_difference(recording: Recording) -> float:
    """Largest |engine's hooked layer output - the unsharded fp32 copy's| on step 1's inputs (no update yet)."""
    input_ids, attention_mask, engine = recording.layer_outputs
    with torch.no_grad():
        hidden = REFERENCE.to(engine.device)(input_ids, attention_mask=attention_mask, output_hidden_states=True)
    reference = hidden.hidden_states[recording.estimator.layer_ + 1]
    return (engine - reference).abs().max().item()


def held_weight(recording: Recording) -> dict:
    """How this rank holds the hooked layer's query weight: its type, its local size, and the unsharded size."""
    layer = find_decoder_layers(recording.accelerator.unwrap_model(recording.model))[recording.estimator.layer_]
    weight = layer.self_attn.q_proj.weight
    return {
        "type": type(weight).__name__,
        "local_numel": (weight.to_local() if hasattr(weight, "to_local") else weight).numel(),
        "numel": find_decoder_layers(REFERENCE)[recording.estimator.layer_].self_attn.q_proj.weight.numel(),
    }


def engine(recording: Recording) -> dict:
    """What ran: accelerate's distributed type and plugin, the wrapped model's class, the process group's backend."""
    state = recording.accelerator.state
    return {
        "distributed_type": state.distributed_type.value,
        "zero_stage": state.deepspeed_plugin.zero_stage if getattr(state, "deepspeed_plugin", None) else None,
        "fsdp_version": state.fsdp_plugin.fsdp_version if getattr(state, "fsdp_plugin", None) else None,
        "wrapped": type(recording.model_wrapped).__name__,
        "weight": recording.held_weight,
        "backend": torch.distributed.get_backend(),
    }


keep_fsdp_on_cpu()
if ON_CPU and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":  # set by `accelerate launch` for DeepSpeed
    no_shared_memory_all_reduce()
first = trainer(OUT / "first")
first.train()
results = {
    "world": first.accelerator.num_processes,
    "engine": engine(first),
    "layer_difference": layer_difference(first),
    "feature_passes": first.feature_passes,
    "steps": first.steps,
    "saves": first.saves,
    "checkpoints": sorted(p.name for p in (OUT / "first").glob("checkpoint-*")),
    "estimator_files": sorted(p.name for p in (OUT / "first" / "checkpoint-2").glob("poise*")),
}
resumed = trainer(OUT / "resumed")
resumed.train(resume_from_checkpoint=str(OUT / "first" / "checkpoint-2"))
results["resumed"] = {"loaded": resumed.loaded, "steps": resumed.steps, "global_step": resumed.state.global_step}
finish(str(OUT), first.accelerator.process_index, results)
