"""The recipes in configs/ hold the paper's values as the training command parses them, and the command runs.

Every recipe goes through `poise-trl train`'s own parser (`poise_trl.rlvr.train`, which `examples/train_poise.py`
wraps), so what is checked here is what a launch would train with. Every recipe trains 2 steps on CPU through
`poise-trl train`, with the model and dataset swapped for local tiny ones on the command line, the way a user
overrides a recipe.
"""

import json
import shlex
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from trl import GRPOConfig
from trl.scripts.vllm_serve import make_parser as make_vllm_serve_parser

from poise_trl import POISEConfig, cli
from poise_trl.presets import preset_value
from poise_trl.rlvr import train as train_poise
from poise_trl.tasks.math_data import DAPO_PROMPT_PREFIX, DAPO_PROMPT_SUFFIX, dataset_hub_id

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"


QWEN3, R1_DISTILL = "Qwen/Qwen3-4B", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
# recipe: (trainer, model, rollouts per prompt, prompts per generation step, training GPUs it assumes,
#          generation steps). Tables 4/5 and App. B; GPU counts as documented in each recipe's header.
RECIPES = {
    "poise_qwen3_4b_dapo.yaml": ("poise", QWEN3, 2, 1024, 8, 120),
    "poise_qwen3_4b_dapo_vllm_colocate.yaml": ("poise", QWEN3, 2, 1024, 8, 120),
    "poise_qwen3_4b_dapo_vllm_server.yaml": ("poise", QWEN3, 2, 1024, 4, 120),
    "poise_r1_distill_1p5b_dapo.yaml": ("poise", R1_DISTILL, 2, 512, 8, 120),
    "paper_poise_qwen3_4b_dapo.yaml": ("poise", QWEN3, 2, 1024, 8, 120),
    "paper_poise_r1_distill_1p5b_dapo.yaml": ("poise", R1_DISTILL, 2, 512, 8, 120),
    "grpo_baseline_qwen3_4b_dapo.yaml": ("grpo", QWEN3, 8, 128, 8, 100),
}
PAPER_PREFIX = "paper_"  # a paper reproduction's file name starts with it; a POISE recipe without it is recommended
MINI_BATCH_PROMPTS = 16  # Tables 4/5 "mini batch size": prompts per optimizer step
VLLM_FIELDS = {"use_vllm", "vllm_mode", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size"}
VLLM_FIELDS |= {"vllm_enable_sleep_mode", "vllm_max_model_length", "vllm_server_host", "vllm_server_port"}
VLLM_FIELDS |= {"vllm_server_timeout"}


def parse_recipe(name: str, *overrides: str):
    """(script_args, training_args, model_args) exactly as the script parses them.

    `--use_cpu true` because the recipes ask for bf16, which TrainingArguments rejects on a machine without a GPU.
    """
    return train_poise.parse_args(["--config", str(CONFIGS / name), "--use_cpu", "true", *overrides])


def test_every_recipe_has_expectations():
    assert {path.name for path in CONFIGS.glob("*.yaml")} == set(RECIPES)


# What `algorithm: paper` in a recipe's header promises: the paper's estimator (§3), nothing beyond it.
PRESET_PROBE = ("probe_alpha", "probe_pca_dims")
PAPER_ALGORITHM = {"probe_partner_reward": False, "probe_bootstrap": "rloo", "prompt_selection": None}
HEADER = "# recipe: "


def recipe_header(name: str) -> dict:
    """A recipe's first line, `# recipe: {algorithm: ..., field: value, ...}`: its promises, machine-readable."""
    first = (CONFIGS / name).read_text().splitlines()[0]
    assert first.startswith(HEADER), f"{name} must start with a `{HEADER}{{...}}` line"
    header = yaml.safe_load(first.removeprefix(HEADER))
    assert isinstance(header, dict) and "algorithm" in header
    return header


@pytest.mark.parametrize("name", sorted(path.name for path in CONFIGS.glob("*.yaml")))
def test_recipe_runs_what_its_header_promises(name):
    header = recipe_header(name)
    algorithm = header.pop("algorithm")
    parsed = parse_recipe(name)
    for key, promised in header.items():
        owner = next(part for part in parsed if hasattr(part, key))
        assert getattr(owner, key) == promised, f"{name}: {key}={getattr(owner, key)!r}, header says {promised!r}"
    script_args, args, _ = parsed
    comments = " ".join(line for line in (CONFIGS / name).read_text().splitlines() if line.startswith("#"))
    if script_args.trainer == "grpo":
        assert algorithm == "dapo-baseline"
        return
    # A POISE recipe named paper_* runs the paper's algorithm; any other runs the library's defaults, and says so.
    assert algorithm == ("paper" if name.startswith(PAPER_PREFIX) else "library-defaults"), (name, algorithm)
    if algorithm == "library-defaults":
        keys = set(yaml.safe_load((CONFIGS / name).read_text()))
        assert not {"probe_preset", "probe_alpha", "probe_pca_dims"} & keys
        assert (CONFIGS / (PAPER_PREFIX + name)).is_file() or "_vllm_" in name, f"{name} has no paper counterpart"
    library_defaults = {key: preset_value(key) for key in PAPER_ALGORITHM}  # the default preset's
    expected = PAPER_ALGORITHM if algorithm == "paper" else library_defaults
    assert {key: getattr(args, key) for key in PAPER_ALGORITHM} == expected
    if algorithm == "paper":
        assert [args.probe_alpha, args.probe_pca_dims] == [preset_value(key, "paper") for key in PRESET_PROBE]
        assert not args.preset_changes()  # every setting of the paper's algorithm
        assert args.probe_layer != "auto"
    if "RLOO bootstrap" in comments or "RLOO baseline" in comments:
        assert args.probe_bootstrap == "rloo", f"{name}'s comments describe an RLOO bootstrap it does not run"


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_holds_paper_values(name):
    trainer, model, num_generations, prompts, gpus, generation_steps = RECIPES[name]
    script_args, args, model_args = parse_recipe(name)

    assert script_args.trainer == trainer
    assert type(args) is (POISEConfig if trainer == "poise" else GRPOConfig)
    assert model_args.model_name_or_path == model
    assert script_args.dataset_name == "DAPO-Math-17k-en"
    assert dataset_hub_id(script_args.dataset_name) == "open-r1/DAPO-Math-17k-Processed"
    # Tables 4/5: shared by POISE and the DAPO baseline.
    assert args.learning_rate == 1e-6
    assert (args.epsilon, args.epsilon_high) == (0.2, 0.28)
    assert args.beta == 0.0
    assert (args.temperature, args.top_p) == (1.0, 1.0)
    assert args.max_completion_length == 8192
    assert args.loss_type == "dapo"
    assert args.num_iterations == 1
    assert args.seed == 42
    # fp32 master weights under bf16 autocast: bf16 weights would round most lr=1e-6 updates away.
    assert model_args.dtype == "float32" and args.bf16

    # Batch: prompts per generation step, 16-prompt mini-batches, and TRL's step count, on the documented GPUs.
    assert args.num_generations == num_generations
    assert args.generation_batch_size == prompts * num_generations
    completions_per_update = args.per_device_train_batch_size * args.gradient_accumulation_steps * gpus
    assert completions_per_update == MINI_BATCH_PROMPTS * num_generations
    assert args.generation_batch_size % (args.per_device_train_batch_size * gpus) == 0
    updates_per_generation = args.generation_batch_size // completions_per_update
    assert args.max_steps == generation_steps * updates_per_generation
    # More than one update per generation, so TRL runs the old-log-prob pass that POISE captures features in.
    assert updates_per_generation > 1

    if trainer == "poise":
        assert args.scale_rewards == "none"
        assert (args.probe_layer, args.probe_pool_tokens) == (19, 10)
        assert args.reasoning_end_marker == "</think>"
        assert args.probe_features == ["prompt", "reasoning", "entropy"]
        preset = "paper" if name.startswith(PAPER_PREFIX) else "release"  # paper: no PCA, alpha 0.01
        assert [args.probe_preset, args.probe_alpha, args.probe_pca_dims] == [
            preset,
            *(preset_value(key, preset) for key in PRESET_PROBE),
        ]
        assert args.probe_buffer_size == 4096
        # The release's bootstrap length in rollouts: 16 steps x 256 prompts x 2.
        assert args.probe_warmup_steps * args.generation_batch_size == 16 * 256 * 2
    else:
        assert args.scale_rewards == "group"  # DAPO's group-normalised advantage
        assert not any(key.startswith("probe_") for key in yaml.safe_load((CONFIGS / name).read_text()))


@pytest.mark.parametrize("name", sorted(name for name in RECIPES if name.startswith(PAPER_PREFIX)))
def test_paper_recipe_differs_from_the_recommended_one_only_in_the_estimator(name):
    paper = yaml.safe_load((CONFIGS / name).read_text())
    recommended = yaml.safe_load((CONFIGS / name.removeprefix(PAPER_PREFIX)).read_text())
    changed = {key for key in paper.keys() | recommended.keys() if paper.get(key) != recommended.get(key)}
    assert changed == {"probe_preset", "probe_partner_reward", "probe_bootstrap", "output_dir"}


@pytest.mark.parametrize("name", ["poise_qwen3_4b_dapo_vllm_colocate.yaml", "poise_qwen3_4b_dapo_vllm_server.yaml"])
def test_vllm_recipes_differ_from_base_only_in_generation(name):
    base = yaml.safe_load((CONFIGS / "poise_qwen3_4b_dapo.yaml").read_text())  # the recommended recipe
    variant = yaml.safe_load((CONFIGS / name).read_text())
    changed = {key for key in base.keys() | variant.keys() if base.get(key) != variant.get(key)}
    # The server recipe trains on 4 of the 8 GPUs, so it accumulates twice as many micro-batches.
    assert changed <= VLLM_FIELDS | {"output_dir", "gradient_accumulation_steps"}
    _, args, _ = parse_recipe(name)
    mode = name.removesuffix(".yaml").rsplit("_", 1)[-1]
    assert args.use_vllm and args.vllm_mode == mode
    if mode == "colocate":
        assert args.vllm_enable_sleep_mode
        assert args.vllm_max_model_length == 2048 + args.max_completion_length  # Table 4 prompt + response


def test_vllm_server_recipe_documents_a_valid_serve_command():
    text = (CONFIGS / "poise_qwen3_4b_dapo_vllm_server.yaml").read_text()
    lines = [line.lstrip("# ").rstrip("\\ ") for line in text.splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(lines) if "trl vllm-serve" in line)
    command = shlex.split(lines[start].split("trl vllm-serve", 1)[1] + " " + lines[start + 1])
    serve_args, extra = make_vllm_serve_parser().parse_args_and_config(command, return_remaining_strings=True)
    _, args, model_args = parse_recipe("poise_qwen3_4b_dapo_vllm_server.yaml")
    assert extra == []
    assert serve_args.model == model_args.model_name_or_path
    assert serve_args.max_model_len == 2048 + args.max_completion_length
    assert serve_args.port == args.vllm_server_port
    assert "--num_processes 4" in text  # the 4 training GPUs the recipe's batch arithmetic assumes


def test_trainer_choice_cli_overrides_recipe():
    recipe = str(CONFIGS / "poise_qwen3_4b_dapo.yaml")
    assert train_poise.trainer_choice(["--config", recipe]) == "poise"
    assert train_poise.trainer_choice(["--config", str(CONFIGS / "grpo_baseline_qwen3_4b_dapo.yaml")]) == "grpo"
    assert train_poise.trainer_choice(["--config", recipe, "--trainer", "grpo"]) == "grpo"
    assert train_poise.trainer_choice([]) == "poise"
    # A POISE recipe under the baseline's GRPOConfig: its probe_* keys are rejected, not silently dropped.
    with pytest.raises(ValueError, match="probe_"):
        parse_recipe("poise_qwen3_4b_dapo.yaml", "--trainer", "grpo")
    with pytest.raises(ValueError, match="choose one of"):
        train_poise.make_parser("ppo")


def test_misspelt_recipe_key_fails(tmp_path):
    recipe = yaml.safe_load((CONFIGS / "poise_qwen3_4b_dapo.yaml").read_text())
    recipe["probe_layr"] = recipe.pop("probe_layer")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ValueError, match="probe_layr"):
        train_poise.parse_args(["--config", str(path), "--use_cpu", "true"])


def test_command_line_overrides_recipe():
    _, args, model_args = parse_recipe(
        "poise_r1_distill_1p5b_dapo.yaml", "--learning_rate", "2e-6", "--probe_layer", "-1", "--use_peft", "true"
    )
    assert args.learning_rate == 2e-6 and args.probe_layer == -1 and model_args.use_peft


ACCELERATE = {  # file: (distributed_type, processes, backend-specific keys)
    "single_gpu.yaml": ("NO", 1, {}),
    "multi_gpu.yaml": ("MULTI_GPU", 8, {}),
    "zero2.yaml": ("DEEPSPEED", 8, {"deepspeed_config": {"zero_stage": 2}}),
    "zero3.yaml": ("DEEPSPEED", 8, {"deepspeed_config": {"zero_stage": 3, "zero3_init_flag": True}}),
    "fsdp2.yaml": ("FSDP", 8, {"fsdp_config": {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP"}}),
}


def test_every_accelerate_config_has_expectations():
    assert {path.name for path in (CONFIGS / "accelerate").glob("*.yaml")} == set(ACCELERATE)


@pytest.mark.parametrize("name", sorted(ACCELERATE))
def test_accelerate_config(name):
    distributed_type, num_processes, backend = ACCELERATE[name]
    path = CONFIGS / "accelerate" / name
    raw = yaml.safe_load(path.read_text())
    config = load_config_from_file(str(path))  # accelerate's own loader: unknown keys raise
    assert config.distributed_type == distributed_type
    assert config.num_processes == num_processes
    assert config.mixed_precision == "bf16" and config.num_machines == 1 and not config.use_cpu
    for section, expected in backend.items():
        assert {key: raw[section][key] for key in expected} == expected
    for section in {"deepspeed_config", "fsdp_config"} - backend.keys():
        assert section not in raw


def _write_dapo_jsonl(path: Path, rows: int) -> Path:
    """Rows in open-r1/DAPO-Math-17k-Processed's schema: templated `prompt`, final answer in `solution`."""
    with path.open("w") as file:
        for i in range(rows):
            answer = str(2 * i + 1)
            row = {
                "prompt": DAPO_PROMPT_PREFIX + f"What is {i} + {i + 1}?" + DAPO_PROMPT_SUFFIX,
                "solution": answer,
                "data_source": "math_dapo",
                "ability": "MATH",
                "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": str(i)},
            }
            file.write(json.dumps(row) + "\n")
    return path


@pytest.mark.slow
def test_recipe_trains_end_to_end_on_tiny_model(tiny_model_path, tmp_path):
    """The Qwen3-4B recipe with model, data and scale overridden: 2 generation steps x 2 updates on CPU."""
    output_dir = tmp_path / "out"
    script_args, args, model_args = parse_recipe(
        "poise_qwen3_4b_dapo.yaml",
        *("--model_name_or_path", str(tiny_model_path)),
        *("--dataset_name", str(_write_dapo_jsonl(tmp_path / "dapo_en.jsonl", rows=6)), "--max_train_samples", "4"),
        *("--output_dir", str(output_dir)),
        *("--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none", "--save_strategy", "no"),
        *("--disable_tqdm", "true", "--logging_steps", "1"),
        # 2 prompts x 2 rollouts per generation, split into 2 optimizer steps, as the recipe splits its 2048.
        *("--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1"),
        *("--generation_batch_size", "4", "--max_steps", "4", "--max_completion_length", "4"),
        *("--probe_layer", "2", "--probe_warmup_steps", "1"),  # the tiny model has 4 layers
    )
    trainer = train_poise.main(script_args, args, model_args)

    assert isinstance(trainer, train_poise.POISETrainer)
    assert trainer.state.global_step == 4
    assert len(trainer.train_dataset) == 4
    assert trainer.estimator.steps_ == 2 and trainer.estimator.probes_["default"].probe.is_fitted
    assert trainer.feature_passes == 0  # features came from TRL's own old-log-prob pass, as in the paper
    assert (output_dir / "model.safetensors").is_file()
    card = (output_dir / "README.md").read_text()
    assert "POISE" in card and "2605.07579" in card
    assert str(tmp_path) not in card  # a local dataset file is not linked as a Hub dataset


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_recipe_trains_two_steps_on_cpu_through_the_cli(name, tiny_model_path, tmp_path):
    """`poise-trl train --config RECIPE` with the CPU variant's overrides (tiny model, 6-row local file, one
    generation step split into 2 optimizer steps): what a user's smoke run does before renting GPUs."""
    trainer, *_ = RECIPES[name]
    output_dir = tmp_path / "out"
    argv = ["train", "--config", str(CONFIGS / name), "--use_cpu", "true", "--bf16", "false", "--use_vllm", "false"]
    argv += ["--model_name_or_path", str(tiny_model_path), "--output_dir", str(output_dir)]
    argv += ["--dataset_name", str(_write_dapo_jsonl(tmp_path / "dapo_en.jsonl", rows=6))]
    argv += ["--gradient_checkpointing", "false", "--report_to", "none", "--disable_tqdm", "true"]
    argv += ["--max_completion_length", "4", "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2"]
    argv += ["--gradient_accumulation_steps", "1"]
    if trainer == "poise":  # 2 prompts x 2 rollouts; the tiny model has 4 layers
        argv += ["--per_device_train_batch_size", "2", "--generation_batch_size", "4", "--probe_layer", "2"]
    else:  # 1 prompt x the baseline's 8 rollouts
        argv += ["--per_device_train_batch_size", "4", "--generation_batch_size", "8"]

    assert cli.main(argv) == 0
    state = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert (output_dir / "model.safetensors").is_file()
    card = (output_dir / "README.md").read_text()
    assert ("## POISE" in card) == (trainer == "poise")


@pytest.mark.parametrize("trainer", ["poise", "grpo"])
def test_too_small_a_training_set_fails_with_the_reason(trainer, tiny_model_path, tmp_path, capsys):
    """2 rows against the recipe's 1024 prompts per generation: TRL alone would train 0 steps and save the model.

    The message is POISETrainer's refusal for POISE and the script's own check for the GRPO baseline; both say
    "too small"."""
    recipe = "poise_qwen3_4b_dapo.yaml" if trainer == "poise" else "grpo_baseline_qwen3_4b_dapo.yaml"
    output_dir = tmp_path / "out"
    argv = ["--config", str(CONFIGS / recipe), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    argv += ["--model_name_or_path", str(tiny_model_path), "--output_dir", str(output_dir)]
    argv += ["--dataset_name", str(_write_dapo_jsonl(tmp_path / "dapo_en.jsonl", rows=2))]
    argv += ["--gradient_checkpointing", "false", "--disable_tqdm", "true", "--max_completion_length", "4"]
    argv += ["--probe_layer", "2"] if trainer == "poise" else []

    assert train_poise.run(argv) == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error" in line.lower()]  # beside datasets' progress bars
    assert len(errors) == 1 and errors[0].startswith("poise-trl train: error: "), captured.err
    assert "too small" in errors[0].lower() and "Traceback" not in captured.err
    assert "Model and model card saved" not in captured.out
    assert not (output_dir / "model.safetensors").exists()
    with pytest.raises(ValueError, match="(?i)too small"):
        train_poise.run([*argv, "--show_traceback", "true"])
