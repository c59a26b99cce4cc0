"""POISETrainer's guards and records: host transfers per step, a too-small training set, unscorable steps, and the two
TRL behaviours the trainer has to copy (pinned here, so a TRL upgrade that changes them fails loudly). The model card:
test_card.py; the selection's trust gate and resumable draws: test_selection.py."""

import functools
import json
from pathlib import Path

import pytest
from datasets import Dataset
from trl import GRPOTrainer

from poise_trl import POISETrainer

from ..conftest import digit_dataset, digit_reward, poise_args, short_args
from ..host_sync import HostSyncCounter

ROOT = Path(__file__).resolve().parents[2]


def _logged(trainer, key: str) -> list:
    return [h[key] for h in trainer.state.log_history if key in h]


def _count_poise_syncs(monkeypatch, trainer) -> HostSyncCounter:
    """A counter active only inside POISE's own code: POISETrainer's overrides count, and every GRPOTrainer method
    they call (TRL's scoring, generation, rewards, log-prob pass) is excluded again."""
    counter, stack = HostSyncCounter(), []
    counter.active = False

    def scoped(cls, name, active):
        original = getattr(cls, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            stack.append(counter.active)
            counter.active = active
            try:
                return original(*args, **kwargs)
            finally:
                counter.active = stack.pop()

        monkeypatch.setattr(cls, name, wrapper)

    overrides = (
        "_generate_and_score_completions",
        "_get_per_token_logps_and_entropies",
        "_calculate_rewards",
        "_compute_loss",
        "training_step",
    )
    for name in overrides:
        scoped(GRPOTrainer, name, False)
        scoped(POISETrainer, name, True)
    scoped(GRPOTrainer, "_generate", False)
    return counter


@pytest.mark.parametrize("extra", [dict(), dict(scale_rewards="batch", num_iterations=2)])
def test_one_host_transfer_per_training_step(tiny_model_path, tmp_path, monkeypatch, extra):
    """POISE's share of a step (features, advantages, logging, the estimator's learning) reads the device once.
    Measured with the same counter before the estimator existed: 58.75 per step (235 in 4 steps)."""
    steps = 4
    trainer = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=short_args(tmp_path, max_steps=steps, **extra),
        train_dataset=digit_dataset(),
    )
    counter = _count_poise_syncs(monkeypatch, trainer)
    with counter:
        trainer.train()
    generations = steps // trainer.num_iterations
    assert counter.count == generations, counter.calls  # exactly one per generation step, the estimator's
    assert _logged(trainer, "poise/bootstrap")[-1] == 0.0  # the probe was in use: refits and predictions counted


def test_a_training_set_smaller_than_one_generation_batch_is_refused(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=2)
    with pytest.raises(
        ValueError, match=r"has 3 prompts, but one generation batch needs 8 distinct prompts.*add data"
    ):
        POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset(3))
    POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset(8))  # exactly enough


def test_columns_trl_or_poise_need_are_checked_before_the_first_step(tiny_model_path, tmp_path):
    """A dataset without `prompt`, without a column a reward function requires (in training or evaluation data), or
    without `probe_domain_column` is refused at construction, naming the dataset's columns; TRL would fail at the
    first step (or the first evaluation) inside its own code. An environment-only dataset: test_tools.py."""
    questions = Dataset.from_list([{"question": f"{i}+1", "answer": str(i + 1)} for i in range(8)])
    with pytest.raises(ValueError, match=r"train_dataset has the columns \['answer', 'question'\] and no 'prompt'"):
        POISETrainer(str(tiny_model_path), digit_reward, args=poise_args(tmp_path), train_dataset=questions)

    def exact(completions, answer, **kwargs):
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    answered = questions.rename_column("question", "prompt")
    args = poise_args(tmp_path, eval_strategy="steps", eval_steps=2)
    POISETrainer(str(tiny_model_path), exact, args=args, train_dataset=answered, eval_dataset=answered)
    with pytest.raises(
        ValueError, match=r"'exact' requires \['answer'\].* train_dataset has the columns \['prompt'\]"
    ):
        POISETrainer(str(tiny_model_path), exact, args=poise_args(tmp_path), train_dataset=digit_dataset())
    evaluations = {"held_out": digit_dataset(8)}
    with pytest.raises(ValueError, match=r"requires \['answer'\].*eval_dataset\['held_out'\] has the columns"):
        POISETrainer(str(tiny_model_path), exact, args=args, train_dataset=answered, eval_dataset=evaluations)
    with pytest.raises(ValueError, match=r"probe_domain_column='topic', but train_dataset has the columns"):
        POISETrainer(
            str(tiny_model_path),
            digit_reward,
            args=poise_args(tmp_path, probe_domain_column="topic"),
            train_dataset=digit_dataset(),
        )


def test_the_training_script_refuses_a_two_row_file_instead_of_training_zero_steps(tiny_model_path, tmp_path):
    """`poise-trl train` (examples/train_poise.py) with the recipe's batch sizes on a 2-row file used to exit 0 after
    0 steps."""
    from poise_trl.rlvr import train as script

    data = tmp_path / "two.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + 1?", "solution": str(i + 1)}) + "\n" for i in (1, 2))
    )
    argv = [
        *("--config", str(ROOT / "configs" / "poise_qwen3_4b_dapo.yaml")),
        *("--model_name_or_path", str(tiny_model_path), "--dataset_name", str(data)),
        *("--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false", "--report_to", "none"),
        *("--probe_layer", "2", "--gradient_checkpointing", "false"),
    ]
    script_args, args, model_args = script.parse_args(argv)
    needed = args.generation_batch_size // args.num_generations
    with pytest.raises(ValueError, match=rf"has 2 prompts, but one generation batch needs {needed} distinct"):
        script.main(script_args, args, model_args)
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_an_all_unscorable_step_warns_once_and_is_counted_apart(tiny_model_path, tmp_path):
    def unscorable(completions, **kwargs):
        return [None] * len(completions)

    trainer = POISETrainer(
        str(tiny_model_path), unscorable, args=poise_args(tmp_path, max_steps=2), train_dataset=digit_dataset()
    )
    with pytest.warns(UserWarning, match="Every one of the 8 completions of this step is unscorable") as caught:
        trainer.train()
    assert sum("unscorable" in str(w.message) for w in caught) == 1  # once, not every step
    assert _logged(trainer, "poise/unscorable_rows") == [8.0, 8.0]
    assert _logged(trainer, "poise/feature_rows_dropped") == [0.0, 0.0]  # their features were fine


@pytest.mark.parametrize(
    ("extra", "reused"),
    [
        (dict(), False),
        (dict(num_iterations=2), True),
        (dict(steps_per_generation=2, per_device_train_batch_size=4), True),
    ],
)
def test_trl_runs_its_old_log_prob_pass_exactly_when_poise_expects(
    tiny_model_path, tmp_path, monkeypatch, extra, reused
):
    """Where TRL runs its old-log-prob pass POISE captures inside it, and otherwise on the loss's forward (TRL's side,
    and POISE's copy of the condition: tests/contract, behaviour 'old_logps_pass')."""
    trainer = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=poise_args(tmp_path, max_steps=2, **extra),
        train_dataset=digit_dataset(),
    )
    outputs = []
    parent = GRPOTrainer._generate_and_score_completions
    monkeypatch.setattr(
        GRPOTrainer,
        "_generate_and_score_completions",
        lambda self, inputs: outputs.append(parent(self, inputs)) or outputs[-1],
    )
    trainer.train()
    assert trainer._trl_runs_old_logps_pass() is reused
    assert all(("old_per_token_logps" in output) is reused for output in outputs)
    assert trainer._capture_route("train") == ("trl_pass" if reused else "loss") and trainer.feature_passes == 0


def test_a_small_eval_set_is_not_refused(tiny_model_path, tmp_path):
    """Only the training set must fill a generation batch; evaluation takes what it gets."""
    args = poise_args(tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer = POISETrainer(
        str(tiny_model_path),
        digit_reward,
        args=args,
        train_dataset=digit_dataset(),
        eval_dataset=Dataset.from_list([{"prompt": "1+2"}, {"prompt": "3+4"}]),
    )
    trainer.train()
    assert _logged(trainer, "eval_poise/mae")
