"""The TRL contract (poise_trl/grpo/contract.py) against the installed TRL: one test per behaviour, named
`test_<behaviour>`, each run on TRL's own `GRPOTrainer` (a recording subclass, as `POISETrainer` is one; nothing is
patched) and failing with the behaviour's name when a TRL release changes it. Two more tests keep the list whole: every
behaviour has its test, and every private TRL name and every override in the trainer's code is named in the list."""

import ast
import inspect
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import RepeatSampler

import poise_trl
from poise_trl import POISETrainer
from poise_trl.features.features import find_decoder_layers
from poise_trl.grpo.contract import CONTRACT
from poise_trl.grpo.validation import REWARD_KEYWORDS, UNPASSED_COLUMNS

from ..conftest import CPU_ARGS, digit_dataset, digit_reward
from ..tiny_archs import env_rollout


def holds(behaviour: str, condition: bool, detail: str) -> None:
    """Fail naming the behaviour of the contract that no longer holds."""
    if not condition:
        pytest.fail(f"TRL contract {behaviour!r} changed: {detail}\nPOISE relies on: {CONTRACT[behaviour].holds}")


class Recorder(GRPOTrainer):
    """GRPOTrainer recording the calls the contract is about, in order."""

    def __init__(self, *args, **kwargs):
        self.calls: list[tuple] = []
        self.outputs: list[dict[str, Any]] = []
        super().__init__(*args, **kwargs)

    def _generate(self, prompts):
        self.calls.append(("generate",))
        return super()._generate(prompts)

    def _calculate_rewards(self, *args):
        rewards = super()._calculate_rewards(*args)
        self.calls.append(("rewards", rewards))
        return rewards

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        self.calls.append(("logps", model, torch.is_grad_enabled()))
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _generate_and_score_completions(self, inputs):
        self.calls.append(("score",))
        output = super()._generate_and_score_completions(inputs)
        output["row"] = list(range(len(inputs)))  # an extra list of B items, as POISE adds (`step.ROW_KEY`)
        self.rng_after_scoring = torch.get_rng_state()
        self.outputs.append(output)
        self.calls.append(("scored",))
        return output

    def _compute_loss(self, model, inputs):
        self.calls.append(("loss", torch.is_grad_enabled()))
        return super()._compute_loss(model, inputs)


class ReadRecorder(dict):
    """A batch dict that records when the loss reads its advantages."""

    def __init__(self, rows: dict, calls: list):
        super().__init__(rows)
        self.calls = calls

    def __getitem__(self, key):
        if key == "advantages":
            self.calls.append(("advantages read",))
        return super().__getitem__(key)


def _trainer(model, tmp_path, reward_funcs=digit_reward, **overrides) -> Recorder:
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, max_steps=1, seed=0)
    rollout = overrides.pop("rollout_func", None)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **CPU_ARGS, **{**settings, **overrides})
    trainer = Recorder(str(model), reward_funcs, args=args, train_dataset=digit_dataset(), rollout_func=rollout)
    trainer.model.train()
    return trainer


def _generation_batch(trainer: Recorder) -> list[dict]:
    return next(iter(trainer.get_train_dataloader()))


def _logps_calls(trainer: Recorder) -> list[tuple]:
    return [call for call in trainer.calls if call[0] == "logps"]


@pytest.mark.parametrize(
    ("settings", "runs_pass"),
    [
        (dict(), False),
        (dict(num_iterations=2), True),
        (dict(steps_per_generation=2), True),
        (dict(gradient_accumulation_steps=2, steps_per_generation=2, per_device_train_batch_size=2), False),
        (dict(gradient_accumulation_steps=2, steps_per_generation=1, num_iterations=2), False),
    ],
)
def test_old_logps_pass(tiny_model_path, tmp_path, settings, runs_pass):
    """TRL's pass and POISE's copy of its condition (the vLLM clause runs in test_vllm.py, vLLM's environment)."""
    trainer = _trainer(tiny_model_path, tmp_path, **settings)
    trainer._prepare_inputs(_generation_batch(trainer))
    passes = [call for call in _logps_calls(trainer) if call[1] is trainer.model and not call[2]]
    holds("old_logps_pass", len(passes) == int(runs_pass), f"{len(passes)} no-grad passes with {settings}")
    holds("old_logps_pass", len(_logps_calls(trainer)) == len(passes), "another pass of the policy while scoring")
    copy = POISETrainer._trl_runs_old_logps_pass(trainer)
    holds("old_logps_pass", copy is runs_pass, f"POISE's copy of the condition says {copy} with {settings}")
    holds("old_logps_pass", ("old_per_token_logps" in trainer.outputs[0]) is runs_pass, "the batch's old log-probs")


def test_scalar_reward(tiny_model_path, tmp_path):
    """TRL's own advantages (scale_rewards="none": reward - group nanmean, unscorable -> 0) from POISE's reading."""

    def half(completions, **kwargs):
        return [None if i % 3 == 0 else 0.5 * len(c) for i, c in enumerate(completions)]

    def none(completions, **kwargs):
        return [None if i == 1 else 1.0 for i, _ in enumerate(completions)]

    trainer = _trainer(
        tiny_model_path, tmp_path, [digit_reward, half, none], reward_weights=[1.0, 0.25, 2.0], scale_rewards="none"
    )
    trainer._prepare_inputs(_generation_batch(trainer))
    (rewards_per_func,) = [call[1] for call in trainer.calls if call[0] == "rewards"]
    rewards = POISETrainer._scalar_rewards(trainer, rewards_per_func)
    expected = torch.nan_to_num(rewards - rewards.view(-1, 2).nanmean(1).repeat_interleave(2), nan=0.0)
    holds(
        "scalar_reward",
        torch.allclose(trainer.outputs[0]["advantages"], expected),
        f"TRL's advantages {trainer.outputs[0]['advantages'].tolist()}, from POISE's reward {expected.tolist()}",
    )


def test_gathered_rewards(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    batch = _generation_batch(trainer)
    trainer._prepare_inputs(batch)
    names = [call[0] for call in trainer.calls if call[0] != "logps"]
    holds("gathered_rewards", names == ["score", "generate", "rewards", "scored"], f"call order {names}")
    (rewards,) = [call[1] for call in trainer.calls if call[0] == "rewards"]
    shape = (len(batch) * trainer.accelerator.num_processes, 1)
    holds("gathered_rewards", tuple(rewards.shape) == shape, f"rewards of shape {tuple(rewards.shape)}")


def test_batch_layout(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    batch = _generation_batch(trainer)
    trainer._prepare_inputs(batch)
    output, rows = trainer.outputs[0], len(batch)
    prompts = [x["prompt"] for x in batch]
    holds("batch_layout", prompts[0::2] == prompts[1::2], f"a group's rows are not consecutive: {prompts}")
    holds("batch_layout", output["advantages"].shape == (rows,), f"advantages {tuple(output['advantages'].shape)}")
    count = output.get("num_items_in_batch")
    holds("batch_layout", isinstance(count, torch.Tensor) and count.ndim == 0, f"num_items_in_batch {count!r}")
    tokens = output["completion_mask"].sum()
    holds("batch_layout", int(count) == int(tokens), f"num_items_in_batch {int(count)} for {int(tokens)} tokens")
    logged = list(trainer._logs["advantages"])[-rows:]
    holds("batch_layout", logged == output["advantages"].tolist(), "_logs['advantages'] does not end with the batch")
    lists = isinstance(trainer._logs["extra"], defaultdict) and isinstance(trainer._metrics["train"], defaultdict)
    holds("batch_layout", lists, "_logs['extra'] and _metrics[mode] are no longer defaultdicts of lists")


def test_train_buffer(tiny_model_path, tmp_path):
    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, steps_per_generation=2)
    trainer = _trainer(tiny_model_path, tmp_path, num_iterations=2, **settings)
    holds("train_buffer", trainer._buffered_inputs is None and trainer._step == 0, "the state __init__ sets")
    batch = _generation_batch(trainer)
    first = trainer._prepare_inputs(batch)
    buffer = trainer._buffered_inputs
    holds("train_buffer", isinstance(buffer, list) and len(buffer) == 2, f"_buffered_inputs is {type(buffer)}")
    holds("train_buffer", first is buffer[0], "the micro-batch returned is not the buffer's first dict")
    holds("train_buffer", all(isinstance(part["row"], list) for part in buffer), "the list is no longer a list")
    rows = [row for part in buffer for row in part["row"]]
    after = torch.get_rng_state()
    torch.set_rng_state(trainer.rng_after_scoring)
    drawn = torch.randperm(len(batch)).tolist()
    holds("train_buffer", rows == drawn, f"the list's items {rows}, one randperm gives {drawn}")
    completions = torch.cat([part["completion_ids"] for part in buffer])
    scored = trainer.outputs[0]["completion_ids"][drawn]
    holds("train_buffer", torch.equal(completions, scored), "a tensor's rows did not travel with the list's items")
    holds("train_buffer", torch.equal(after, torch.get_rng_state()), "more than one draw shuffled the batch")
    for step, part in [(1, buffer[1]), (2, first), (3, buffer[1])]:  # two iterations over the same dicts
        trainer._step = step
        holds("train_buffer", trainer._prepare_inputs(batch) is part, f"_step {step} returned another micro-batch")
    holds("train_buffer", len(trainer.outputs) == 1 and trainer._buffered_inputs is buffer, "generated again")
    trainer._step = 4
    trainer._prepare_inputs(batch)
    holds("train_buffer", len(trainer.outputs) == 2, "no new batch at _step % (spg * num_iterations) == 0")
    trainer._buffered_inputs, trainer._step = None, 1
    trainer._prepare_inputs(batch)
    holds("train_buffer", len(trainer.outputs) == 3, "a None buffer does not make TRL generate")
    trainer._buffered_inputs, trainer._step = None, 0
    trainer.train()
    holds("train_buffer", trainer._step == 2, f"_step is {trainer._step} after one step of two micro-batches")


def test_loss_forward(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    inputs = trainer._prepare_inputs(_generation_batch(trainer))
    trainer.calls.clear()
    trainer.current_gradient_accumulation_steps = 1  # what `train()` sets before its first step
    loss = trainer._compute_loss(trainer.model, ReadRecorder(inputs, trainer.calls))
    order = [call[0] for call in trainer.calls]
    holds("loss_forward", order.count("logps") == 1, f"{order.count('logps')} forwards in `_compute_loss`")
    forward = next(call for call in trainer.calls if call[0] == "logps")
    holds("loss_forward", forward[1] is trainer.model and forward[2], "the forward's model or grad mode")
    holds("loss_forward", order.index("logps") < order.index("advantages read"), f"call order {order}")
    width = inputs["completion_ids"].size(1)
    per_token = {**inputs, "advantages": inputs["advantages"].unsqueeze(1).expand(-1, width)}
    torch.testing.assert_close(trainer._compute_loss(trainer.model, per_token), loss)

    class Steps(Recorder):
        def training_step(self, model, inputs, num_items_in_batch):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.calls.append(("after backward", all(p.grad is not None for p in model.parameters())))
            return loss

    settings = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=2, seed=0)
    args = GRPOConfig(output_dir=str(tmp_path / "steps"), **CPU_ARGS, **settings, max_steps=1)
    steps = Steps(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    steps.train()
    order = [call[0] for call in steps.calls if call[0] in ("loss", "after backward")]
    holds("loss_forward", order == ["loss", "after backward"] * 2, f"training_step's calls {order}")
    grads = [call[1] for call in steps.calls if call[0] == "after backward"]
    holds("loss_forward", all(grads), "no gradient after training_step returned")


def test_eval_batches(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    trainer.model.eval()
    batch = _generation_batch(trainer)[:4]
    returned = trainer._prepare_inputs(batch)
    holds("eval_batches", returned is trainer.outputs[-1], "evaluation's micro-batch is not the scored batch itself")
    trainer.calls.clear()
    trainer.prediction_step(trainer.model, batch, prediction_loss_only=True)
    losses = [call for call in trainer.calls if call[0] == "loss"]
    holds("eval_batches", losses == [("loss", False)], f"the evaluation batch's losses {losses}")


def test_logps_call(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    parameters = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters
    needed = ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"]
    holds("logps_call", all(name in parameters for name in needed), f"parameters {list(parameters)}")
    layer = find_decoder_layers(trainer.accelerator.unwrap_model(trainer.model))[0]
    seen = []
    handle = layer.register_forward_hook(lambda *args: seen.append(True))
    ids = torch.tensor([[5, 6, 7, 8]])
    try:
        with torch.no_grad():
            result = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, torch.ones_like(ids), 2, batch_size=1, compute_entropy=True
            )
    finally:
        handle.remove()
    holds("logps_call", isinstance(result, tuple) and len(result) == 3, f"returns {type(result)}")
    logps, entropies, _ = result
    holds("logps_call", logps.shape == (1, 2) and entropies is not None and entropies.shape == (1, 2), "shapes")
    holds("logps_call", bool(seen), "the forward did not run the unwrapped model's decoder layers")


def test_generate_tool_mask(tiny_model_path, tmp_path):
    prompts = [x["prompt"] for x in _generation_batch(_trainer(tiny_model_path, tmp_path / "plain"))]
    plain = _trainer(tiny_model_path, tmp_path / "plain")._generate(prompts)
    holds("generate_tool_mask", isinstance(plain, tuple) and plain[2] is None, "no tools: the third item is None")
    rollout = env_rollout(lambda i: [("12", 1), ("ab", 0), ("3", 1)])
    tools = _trainer(tiny_model_path, tmp_path / "tools", rollout_func=rollout)._generate(prompts)
    holds("generate_tool_mask", [list(m) for m in tools[2]] == [[1, 1, 0, 0, 1]] * 4, f"mask {tools[2]}")


def test_prompt_tokens(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    batch = _generation_batch(trainer)
    trainer._prepare_inputs(batch)
    ids = trainer._tokenize_prompts([x["prompt"] for x in batch])[0]
    output = trainer.outputs[0]
    generated = [
        row[mask.bool()].tolist() for row, mask in zip(output["prompt_ids"], output["prompt_mask"], strict=True)
    ]
    holds("prompt_tokens", [list(x) for x in ids] == generated, "`_tokenize_prompts` is not what TRL generates from")
    holds("prompt_tokens", trainer._tokenizer is trainer.processing_class and trainer._is_vlm is False, "tokenizer")


def test_train_sampler(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path, steps_per_generation=2)
    sampler = trainer._get_train_sampler()
    distinct = trainer.args.generation_batch_size // trainer.num_generations
    holds("train_sampler", isinstance(sampler, RepeatSampler), f"the sampler is {type(sampler).__name__}")
    holds("train_sampler", sampler.batch_size == distinct, f"batch_size {sampler.batch_size}, {distinct} expected")
    parameters = inspect.signature(trainer._get_dataloader).parameters
    needed = ["dataset", "description", "batch_size", "sampler_fn", "is_training"]
    holds("train_sampler", all(name in parameters for name in needed), f"_get_dataloader({list(parameters)})")


def test_repeat_sampler(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path, steps_per_generation=2)
    sampler = trainer._get_train_sampler()
    state = vars(sampler)
    named = CONTRACT["repeat_sampler"].names
    holds("repeat_sampler", all(name in state for name in named), f"its instance dict holds {sorted(state)}")
    holds("repeat_sampler", isinstance(sampler.generator, torch.Generator), f"generator {sampler.generator!r}")
    settings = (sampler.shuffle, sampler.seed, sampler.num_samples)
    holds("repeat_sampler", settings == (True, 0, len(digit_dataset())), f"(shuffle, seed, num_samples) {settings}")
    sampler.batch_size = 3  # set after TRL built it, as prompt selection does
    generator = torch.Generator().manual_seed(sampler.seed)
    for epoch in range(2):
        order = torch.randperm(sampler.num_samples, generator=generator).tolist()
        drawn = list(dict.fromkeys(sampler))  # each prompt once, in the order drawn
        kept = sampler.num_samples // 3 * 3
        holds("repeat_sampler", drawn == order[:kept], f"epoch {epoch} draws {drawn}, one randperm gives {order}")
    copy = type(sampler).__new__(type(sampler))
    vars(copy).update(state)  # as `ResumableSampler` copies it: the same generator object
    passes = []
    for each in (copy, sampler):
        sampler.generator.manual_seed(sampler.seed)
        passes.append(list(each))
    holds("repeat_sampler", passes[0] == passes[1], "a copy of its instance dict does not sample as it does")


def _checkpointing(tmp_path) -> GRPOConfig:
    """One step, saved as a checkpoint."""
    settings = dict(save_steps=1, max_steps=1, per_device_train_batch_size=4, num_generations=2, seed=0)
    return GRPOConfig(output_dir=str(tmp_path / "out"), **{**CPU_ARGS, "save_strategy": "steps"}, **settings)


def test_checkpoint_hooks(tiny_model_path, tmp_path):
    class Saving(Recorder):
        def _save_checkpoint(self, model, trial):
            folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{self.state.global_step}"
            self.calls.append(("save", (folder / "trainer_state.json").exists()))
            super()._save_checkpoint(model, trial)
            self.calls.append(("saved", (folder / "trainer_state.json").exists()))

        def _load_optimizer_and_scheduler(self, checkpoint):
            self.calls.append(("load", checkpoint))
            super()._load_optimizer_and_scheduler(checkpoint)

    trainer = Saving(str(tiny_model_path), digit_reward, args=_checkpointing(tmp_path), train_dataset=digit_dataset())
    trainer.train()
    saves = [call for call in trainer.calls if call[0] in ("save", "saved")]
    holds("checkpoint_hooks", saves == [("save", False), ("saved", True)], f"saves {saves}")
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    trainer.calls.clear()
    trainer.train(resume_from_checkpoint=checkpoint)
    loads = [call for call in trainer.calls if call[0] == "load"]
    holds("checkpoint_hooks", ("load", checkpoint) in loads, f"resuming called {loads}")


def test_save_model(tiny_model_path, tmp_path):
    class Pushed(Exception):
        """Stops `push_to_hub` at its save, before anything reaches the network."""

    class Saving(Recorder):
        def save_model(self, output_dir=None, _internal_call=False):
            folder = Path(self.args.output_dir if output_dir is None else output_dir)
            self.calls.append(("save_model", output_dir, _internal_call, (folder / "trainer_state.json").exists()))
            if self.args.push_to_hub:
                raise Pushed
            super().save_model(output_dir, _internal_call)

    parameters = list(inspect.signature(GRPOTrainer.save_model).parameters)
    holds("save_model", parameters == ["self", "output_dir", "_internal_call"], f"save_model{parameters}")
    trainer = Saving(str(tiny_model_path), digit_reward, args=_checkpointing(tmp_path), train_dataset=digit_dataset())
    trainer.train()
    checkpoint = str(tmp_path / "out" / "checkpoint-1")
    saves = [call for call in trainer.calls if call[0] == "save_model"]
    holds("save_model", saves == [("save_model", checkpoint, True, False)], f"a checkpoint's saves {saves}")
    holds("save_model", (Path(checkpoint) / "trainer_state.json").exists(), "no trainer state after the save")
    trainer.save_model(str(tmp_path / "final"))
    written = sorted(path.name for path in (tmp_path / "final").iterdir())
    holds("save_model", "model.safetensors" in written and "config.json" in written, f"save_model wrote {written}")
    trainer.calls.clear()
    trainer.args.push_to_hub, trainer.hub_model_id = True, "user/tiny"  # set after construction: no repository made
    with pytest.raises(Pushed):
        trainer.push_to_hub()
    saves = [call[:3] for call in trainer.calls if call[0] == "save_model"]
    holds("save_model", saves == [("save_model", None, True)], f"push_to_hub's saves {saves}")


def test_dataset_columns(tiny_model_path, tmp_path):
    received = []

    def keywords(completions, **kwargs):
        received.append({"completions", *kwargs})
        return [1.0] * len(completions)

    rows = [{"prompt": f"{i}+1", "answer": str(i + 1), "completion": "x", "completion_ids": [1]} for i in range(8)]
    trainer = _trainer(tiny_model_path, tmp_path, reward_funcs=keywords)
    trainer._prepare_inputs(rows[:4])
    expected = {*REWARD_KEYWORDS, *(c for c in rows[0] if c not in UNPASSED_COLUMNS)}
    holds("dataset_columns", received == [expected], f"a reward function received {received}, not {expected}")
    unprompted = [{"question": row["prompt"]} for row in rows[:4]]
    with pytest.raises(KeyError, match="prompt"):
        _trainer(tiny_model_path, tmp_path)._prepare_inputs(unprompted)


def test_model_card(tiny_model_path, tmp_path):
    trainer = _trainer(tiny_model_path, tmp_path)
    trainer.create_model_card()
    card = (tmp_path / "out" / "README.md").read_text()
    holds("model_card", "### Framework versions" in card, "no '### Framework versions' section")
    holds("model_card", all(tag in card for tag in GRPOTrainer._tag_names), "the class's tags are not on the card")
    holds("model_card", GRPOTrainer._paper["id"] in card, "the class's paper is not on the card")


def test_every_behaviour_has_its_test():
    tests = {name for name in globals() if name.startswith("test_")}
    assert sorted(name for name in CONTRACT if f"test_{name}" not in tests) == []


PACKAGE = Path(poise_trl.__file__).parent
ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _trainer_classes() -> set[str]:
    """The names of POISE's classes `POISETrainer` is made of (itself and its mixins): their `def`s and class-level
    assignments override TRL's when TRL's trainer has the name."""
    return {cls.__name__ for cls in POISETrainer.__mro__ if cls.__module__.startswith("poise_trl")}


def _sampler_names(tree: ast.AST) -> set[str]:
    """Attributes read or written, in `tree`, on a `RepeatSampler`: `self` in a subclass of it, a parameter
    annotated with it, or what `_get_train_sampler` returns (directly or bound to a name)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and getattr(getattr(node.value, "func", None), "attr", "").endswith(
            "_get_train_sampler"
        ):
            found.add(node.attr)
        holders = set()
        if isinstance(node, ast.ClassDef) and any(getattr(base, "id", "") == "RepeatSampler" for base in node.bases):
            holders.add("self")
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            for inner in ast.walk(node):
                if isinstance(inner, ast.arg) and getattr(inner.annotation, "id", "") == "RepeatSampler":
                    holders.add(inner.arg)
                if isinstance(inner, ast.Assign) and getattr(inner.value, "func", None) is not None:
                    if getattr(inner.value.func, "attr", "") == "_get_train_sampler":
                        holders |= {target.id for target in inner.targets if isinstance(target, ast.Name)}
            found |= {
                inner.attr
                for inner in ast.walk(node)
                if isinstance(inner, ast.Attribute) and getattr(inner.value, "id", "") in holders
            }
    return found


def scan(package: Path) -> dict[str, dict[str, set[str]]]:
    """What every module of `package` does with names: `private` (a private attribute of any object, or a literal
    name given to getattr & co), `read_on_self` (private attributes read on `self`), `defined` (names a `def`, a
    class body or an assignment to an attribute defines), `sampler` (`RepeatSampler` attributes used) and, in the
    classes `POISETrainer` is made of, `members` (their `def`s and class-level assignments); by module."""
    trainer_classes, found = _trainer_classes(), {}
    for path in sorted(package.rglob("*.py")):
        tree, names = ast.parse(path.read_text()), defaultdict(set)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                names["private"].add(node.attr)
                if getattr(node.value, "id", "") == "self" and isinstance(node.ctx, ast.Load):
                    names["read_on_self"].add(node.attr)
                if isinstance(node.ctx, ast.Store):
                    names["defined"].add(node.attr)
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ATTRIBUTE_CALLS and len(node.args) > 1:
                literal = node.args[1]
                if isinstance(literal, ast.Constant) and isinstance(literal.value, str) and _private(literal.value):
                    names["private"].add(literal.value)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names["defined"].add(node.name)
            if isinstance(node, ast.ClassDef):
                body = set()
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        body.add(item.name)
                    targets = item.targets if isinstance(item, ast.Assign) else []
                    if isinstance(item, ast.AnnAssign | ast.AugAssign):
                        targets = [item.target]
                    body |= {target.id for target in targets if isinstance(target, ast.Name)}
                names["defined"] |= body
                if node.name in trainer_classes:
                    names["members"] |= body
        names["sampler"] = _sampler_names(tree)
        found[str(path.relative_to(package))] = names
    return found


def _by_module(found: dict[str, dict[str, set[str]]], kind: str, wanted: set[str]) -> dict[str, list[str]]:
    return {module: sorted(names[kind] & wanted) for module, names in found.items() if names[kind] & wanted}


def test_the_contract_names_every_trl_name_and_override_the_trainer_relies_on(tiny_model_path, tmp_path):
    """Over every module of the package: each private name of TRL's trainer (one a `GRPOTrainer` has once built or
    once trained, as names `train()` sets; read or written on any object, `self`, an alias or another, or given to
    getattr & co by a literal) is one of a behaviour's `names` or `overrides`; each `RepeatSampler` attribute used
    on a sampler is a 'RepeatSampler' behaviour's; each override of a TRL method or class attribute, by `def` or by
    assignment, in the classes `POISETrainer` is made of, is a behaviour's `overrides`; a private name read on `self`
    is POISE's own or TRL's; and the contract names nothing the code no longer uses."""
    grpo = _trainer(tiny_model_path, tmp_path)
    trl_names = {name for name in dir(grpo) if _private(name)}
    grpo.train()
    trl_names |= {name for name in dir(grpo) if _private(name)}
    sampler_names = set(vars(grpo._get_train_sampler()))
    found = scan(PACKAGE)
    used = set().union(*(names["private"] for names in found.values())) & trl_names
    sampled = set().union(*(names["sampler"] for names in found.values())) & sampler_names
    members = set().union(*(names["members"] for names in found.values()))
    overrides = {name for name in members if hasattr(GRPOTrainer, name) and name != "__init__"}
    defined = set().union(*(names["defined"] for names in found.values()))
    unknown = set().union(*(names["read_on_self"] for names in found.values())) - defined - trl_names
    named = {name for b in CONTRACT.values() if b.owner == "GRPOTrainer" for name in b.names}
    sampler_named = {name for b in CONTRACT.values() if b.owner == "RepeatSampler" for name in b.names}
    listed = {name for behaviour in CONTRACT.values() for name in behaviour.overrides}
    assert _by_module(found, "members", overrides - listed) == {}, "overrides of TRL's no behaviour names"
    assert sorted(listed - overrides) == [], "behaviours name overrides the trainer no longer has"
    assert _by_module(found, "private", used - named - listed) == {}, "private TRL names no behaviour names"
    assert sorted(named - used) == [], "behaviours name private TRL names the code no longer uses"
    assert _by_module(found, "sampler", sampled - sampler_named) == {}, "RepeatSampler attributes no behaviour names"
    assert sorted(sampler_named - sampled) == [], "behaviours name RepeatSampler attributes no longer used"
    assert _by_module(found, "read_on_self", unknown) == {}, (
        "private names read on self that neither POISE nor TRL sets"
    )
