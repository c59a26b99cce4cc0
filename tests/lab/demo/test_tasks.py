"""The digit-sorting task: deterministic disjoint splits, the reward on hand cases, warm start, avg@k, caching."""

import json

import pytest
import torch

from poise_lab.models import toy as demo_model
from poise_lab.models.toy import evaluate_avg_at_k, load_demo_model, prepare_demo_model, warm_start
from poise_lab.tasks.toy import (
    MAX_COMPLETION_LENGTH,
    REASONING_END,
    extract_answer,
    hop_chain,
    make_hops_splits,
    make_sort_splits,
    make_splits,
    target_completion,
    task_reward,
)
from poise_trl.tiny import build_tiny_model, build_tiny_tokenizer


def test_splits_are_deterministic_in_seed():
    a_train, a_eval = make_sort_splits(num_train=300, num_eval=35, seed=3)
    b_train, b_eval = make_sort_splits(num_train=300, num_eval=35, seed=3)
    c_train, _ = make_sort_splits(num_train=300, num_eval=35, seed=4)
    assert a_train.to_dict() == b_train.to_dict()
    assert a_eval.to_dict() == b_eval.to_dict()
    assert a_train["prompt"] != c_train["prompt"]


def test_splits_are_disjoint_well_formed_and_cover_the_difficulties():
    train, held_out = make_sort_splits(num_train=2000, num_eval=140, min_digits=2, max_digits=8, seed=0)
    assert set(train.column_names) == {"prompt", "answer", "k", "reasoning"}
    assert train["reasoning"] == [str(k) for k in train["k"]]  # sort's reasoning token: the digit count
    assert len(train) == 2000 and len(held_out) == 140
    assert not set(train["prompt"]) & set(held_out["prompt"])
    assert len(set(held_out["prompt"])) == len(held_out)
    assert sorted(set(held_out["k"])) == list(range(2, 9))
    assert all(held_out["k"].count(k) == 20 for k in range(2, 9))  # balanced, so avg@k weighs every difficulty
    assert set(train["k"]) == set(range(2, 9))
    for prompt, answer, k in zip(train["prompt"], train["answer"], train["k"], strict=True):
        digits = prompt.removesuffix("=")
        assert prompt.endswith("=") and digits.isdigit() and len(digits) == k
        assert answer == "".join(sorted(digits))


def test_splits_reject_impossible_requests():
    with pytest.raises(ValueError, match="within"):
        make_sort_splits(min_digits=3, max_digits=10)
    with pytest.raises(ValueError, match="held-out"):
        make_sort_splits(num_eval=200, min_digits=1, max_digits=2)


@pytest.mark.parametrize(
    ("completion", "answer", "reward"),
    [
        ("5</think>11335", "11335", 1.0),
        ("</think>11335", "11335", 1.0),  # the reasoning may be empty
        ("5</think>11335\n", "11335", 1.0),
        ("3</think>9</think>11335", "11335", 1.0),  # the last marker counts
        ("5</think>13135", "11335", 0.0),
        ("5</think>1133", "11335", 0.0),  # a digit dropped
        ("5</think>113355", "11335", 0.0),
        ("511335", "11335", 0.0),  # no marker: no final answer
        ("11335</think>", "11335", 0.0),  # the answer inside the reasoning does not count
        ([{"role": "assistant", "content": "2</think>07"}], "07", 1.0),
    ],
)
def test_task_reward_hand_cases(completion, answer, reward):
    assert task_reward([completion], [answer]) == [reward]


def test_task_reward_ignores_extra_dataset_columns_and_checks_lengths():
    assert task_reward(["2</think>07", "2</think>70"], ["07", "07"], k=[2, 2], prompts=["70=", "70="]) == [1.0, 0.0]
    with pytest.raises(ValueError):
        task_reward(["2</think>07"], ["07", "07"])


def test_target_survives_the_tokenizer_round_trip_trl_uses():
    """TRL decodes completions with skip_special_tokens=True: the marker must survive that, as one token."""
    tokenizer = build_tiny_tokenizer()
    target = target_completion("11335")
    ids = tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert ids.count(tokenizer.convert_tokens_to_ids(REASONING_END)) == 1
    assert len(ids) == 1 + 1 + 5 + 1
    assert extract_answer(tokenizer.decode(ids, skip_special_tokens=True)) == "11335"
    assert len(tokenizer(target_completion("0" * 9))["input_ids"]) + 1 <= MAX_COMPLETION_LENGTH


def test_warm_start_raises_sampled_accuracy():
    train, held_out = make_sort_splits(num_train=300, num_eval=20, min_digits=2, max_digits=2, seed=0)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    before = evaluate_avg_at_k(model, tokenizer, held_out, k=4, seed=0)
    losses = warm_start(model, tokenizer, train, steps=50, lr=1e-3, seed=0, batch_size=32)
    after = evaluate_avg_at_k(model, tokenizer, held_out, k=4, seed=0)
    assert before["avg_at_k"] < 0.05
    assert after["avg_at_k"] > before["avg_at_k"] + 0.2  # 0.40 measured
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert not model.training


def test_evaluate_avg_at_k_shapes_and_determinism():
    _, held_out = make_sort_splits(num_train=10, num_eval=6, min_digits=2, max_digits=4, seed=1)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    first = evaluate_avg_at_k(model, tokenizer, held_out, k=3, seed=5, batch_size=4)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left alone
    second = evaluate_avg_at_k(model, tokenizer, held_out, k=3, seed=5, batch_size=4)
    assert first == second
    assert len(first["per_prompt"]) == 6 and first["k"] == 3
    assert all(r in (0.0, 1 / 3, 2 / 3, 1.0) for r in first["per_prompt"])
    assert set(first["by_difficulty"]) == {2, 3, 4}
    assert first["avg_at_k"] == pytest.approx(sum(first["per_prompt"]) / 6)


def test_prepare_demo_model_reuses_its_cache(tmp_path):
    kwargs = dict(seed=0, warmup_steps=2, num_train=50, min_digits=2, max_digits=4)
    path = prepare_demo_model(tmp_path, **kwargs)
    weights = next(path.glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    info = json.loads((path / "warm_start.json").read_text())
    assert info["settings"]["warmup_steps"] == 2 and info["final_loss"] > 0
    assert prepare_demo_model(tmp_path, **kwargs) == path
    assert weights.stat().st_mtime_ns == stamp  # not retrained
    other = prepare_demo_model(tmp_path, **{**kwargs, "warmup_steps": 3})
    assert other != path and (other / "warm_start.json").exists()
    model, tokenizer = load_demo_model(path)
    assert tokenizer.padding_side == "left"
    assert tokenizer.convert_tokens_to_ids(REASONING_END) == 3
    assert model.config.num_hidden_layers == 4


def test_prepare_demo_model_warm_starts_on_the_callers_train_split(tmp_path, monkeypatch):
    """The held-out prompts are drawn first, so `num_eval` changes the train split: the warm start must use the
    caller's, or held-out prompts leak into it (issue 16: with --num-eval 300, 33 did)."""
    seen = []
    monkeypatch.setattr(
        demo_model, "warm_start", lambda model, tokenizer, dataset, **kw: seen.append(dataset) or [1.0]
    )
    kwargs = dict(seed=0, warmup_steps=1, num_train=400, min_digits=3, max_digits=5)
    small = prepare_demo_model(tmp_path, num_eval=10, **kwargs)
    large = prepare_demo_model(tmp_path, num_eval=300, **kwargs)
    assert small != large  # the cache is keyed on num_eval
    assert json.loads((large / "warm_start.json").read_text())["settings"]["num_eval"] == 300
    _, held_out = make_sort_splits(num_train=400, num_eval=300, min_digits=3, max_digits=5, seed=0)
    assert not set(seen[1]["prompt"]) & set(held_out["prompt"])
    _, other_held_out = make_sort_splits(num_train=400, num_eval=10, min_digits=3, max_digits=5, seed=0)
    assert set(seen[0]["prompt"]) != set(seen[1]["prompt"]) and other_held_out["prompt"] != held_out["prompt"]
    hops = prepare_demo_model(tmp_path, num_eval=10, task="hops", **kwargs)
    assert hops.name.startswith("hops_") and seen[2]["k"] and max(seen[2]["k"]) == 3
    with pytest.raises(ValueError, match="unknown task"):
        prepare_demo_model(tmp_path, task="nosuchtask")


def test_hops_has_one_length_and_difficulty_in_the_content():
    train, held_out = make_hops_splits(num_train=500, num_eval=40, seed=1)
    assert make_hops_splits(num_train=500, num_eval=40, seed=1)[1].to_dict() == held_out.to_dict()
    assert not set(train["prompt"]) & set(held_out["prompt"])
    assert [held_out["k"].count(h) for h in range(4)] == [10, 10, 10, 10]
    tokenizer = build_tiny_tokenizer()
    lengths = set()
    for rows in (train, held_out):
        assert len({len(p) for p in rows["prompt"]}) == 1 and len({len(a) for a in rows["answer"]}) == 1
        for prompt, answer, hops, reasoning in zip(rows["prompt"], rows["answer"], rows["k"], rows["reasoning"],
                                                   strict=True):  # fmt: skip
            digits = prompt[2:-1]
            chain = hop_chain(digits, hops)
            assert prompt[0] == str(hops) and answer == f"{chain[-2]}{chain[-1]}" and reasoning == digits[0]
            lengths.add(len(tokenizer(target_completion(answer, reasoning))["input_ids"]))
    assert lengths == {4}  # every completion is 4 tokens (+ EOS), whatever the difficulty
    assert hop_chain("1234567890", 0) == [1, 2] and hop_chain("1234567890", 2) == [1, 2, 3, 4]
    assert make_splits("hops", 500, 40, seed=1)[1].to_dict() == held_out.to_dict()
    assert task_reward(
        [f"{held_out['reasoning'][0]}{REASONING_END}{held_out['answer'][0]}"], held_out["answer"][:1]
    ) == [1.0]
