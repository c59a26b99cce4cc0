"""POISE under the engines users scale out on, for real: DeepSpeed ZeRO-2/3 and FSDP1/2 on 2 CPU processes (gloo),
launched with `accelerate launch --config_file configs/accelerate/<engine>.yaml` as a user would (bf16 off: CPU).

One launch per engine trains 3 steps, saves at step 2 and resumes from that checkpoint (tests/scenarios/distributed/
engine_ranks.py). accelerate 1.15 turns FSDP on CPU into plain DDP without a word; engine_ranks.py's
`keep_fsdp_on_cpu` patches `AcceleratorState.__init__` so FSDP really runs, which `distributed_type` checks here.
`POISE_TEST_DEVICE=cuda` runs the same launches on 2 GPUs (NCCL, fp32).
"""

import os
from functools import cache
from pathlib import Path

import pytest

from .distributed.launch import ROOT, launch

SCRIPT = Path(__file__).parent / "distributed" / "engine_ranks.py"
DEVICE = os.environ.get("POISE_TEST_DEVICE", "cpu")
FP32 = ["--mixed_precision=no"]  # fp32 everywhere: the hooked layer is compared with an fp32 copy
# name -> (accelerate arguments, extra environment, capture: "trl-pass" = inside TRL's old-log-prob pass, "loss" = the
# loss's own forward (TRL runs no pass), "own-pass" = a no-grad pass of POISE's own (probe_capture="pass"))
ENGINES = {
    "zero2": (["--config_file", str(ROOT / "configs/accelerate/zero2.yaml"), *FP32], {}, "own-pass"),
    "zero3": (["--config_file", str(ROOT / "configs/accelerate/zero3.yaml"), *FP32], {}, "loss"),
    "fsdp2": (["--config_file", str(ROOT / "configs/accelerate/fsdp2.yaml"), *FP32], {}, "loss"),
    # FSDP1 on CPU: no rank-0 loading broadcast, device "cpu" (torch rejects "cpu:0" as a device_id), and sharded
    # checkpoints (a FULL_STATE_DICT save kills rank 0 with SIGSEGV on CPU, plain GRPOTrainer's too; torch 2.13).
    "fsdp1": (
        [
            "--config_file",
            str(ROOT / "configs/accelerate/fsdp2.yaml"),
            *FP32,
            "--fsdp_version=1",
            "--fsdp_cpu_ram_efficient_loading=false",
            "--fsdp_sync_module_states=false",
            "--fsdp_state_dict_type=SHARDED_STATE_DICT",
        ],  # fmt: skip
        {"ACCELERATE_TORCH_DEVICE": "cpu"} if DEVICE == "cpu" else {},
        "trl-pass",
    ),
}
# name -> (distributed_type, ZeRO stage, FSDP version, the class the trainer's `model_wrapped` has)
EXPECTED = {
    "zero2": ("DEEPSPEED", 2, None, "DeepSpeedEngine"),
    "zero3": ("DEEPSPEED", 3, None, "DeepSpeedEngine"),
    "fsdp2": ("FSDP", None, 2, "FSDPQwen3ForCausalLM"),
    "fsdp1": ("FSDP", None, 1, "FullyShardedDataParallel"),
}


@pytest.fixture(scope="module")
def run(tiny_model_path, tmp_path_factory):
    """engine -> its two ranks' results, each engine launched once per module."""

    @cache
    def engine_run(name: str) -> list[dict]:
        accelerate, env, capture = ENGINES[name]
        out = tmp_path_factory.mktemp(name)
        args = [str(tiny_model_path), str(out), capture, DEVICE]
        return launch(SCRIPT, args, out, accelerate=accelerate, env_vars=env)

    return engine_run


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINES)
def test_the_engine_really_runs_and_shards_the_hooked_layer(run, name):
    ranks = run(name)
    for rank in ranks:
        engine = rank["engine"]
        ran = (engine["distributed_type"], engine["zero_stage"], engine["fsdp_version"], engine["wrapped"])
        assert ran == EXPECTED[name], engine
        assert engine["backend"] == ("gloo" if DEVICE == "cpu" else "nccl")
    held = [rank["engine"]["weight"]["local_numel"] for rank in ranks]  # of the hooked layer's query weight
    full = ranks[0]["engine"]["weight"]["numel"]
    if name == "zero2":
        assert held == [full, full]  # ZeRO-2 replicates the weights
    elif name == "zero3":
        assert held == [0, 0]  # partitioned away outside the forward, gathered only inside it
    else:  # each rank holds its shard (FSDP2: half of a DTensor; FSDP1: its part of the flat parameter)
        assert sum(held) == full and held != [full, full]
        assert name == "fsdp1" or all(rank["engine"]["weight"]["type"] == "DTensor" for rank in ranks)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINES)
def test_the_hooked_layer_output_equals_an_unsharded_fp32_copy(run, name):
    """Step 1, before any update: the layer POISE hooks, run by the engine, gives what a plain fp32 copy gives."""
    for rank in run(name):
        assert rank["layer_difference"] == 0.0
        # "own-pass": one pass of POISE's own a step; otherwise TRL's pass or the loss's forward served
        assert rank["feature_passes"] == (len(rank["steps"]) if ENGINES[name][2] == "own-pass" else 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINES)
def test_ranks_hold_identical_estimators_after_each_step(run, name):
    rank0, rank1 = run(name)
    assert len(rank0["steps"]) == (2 if ENGINES[name][2] == "trl-pass" else 3)  # generation batches
    assert [s["digest"] for s in rank0["steps"]] == [s["digest"] for s in rank1["steps"]]
    assert len({s["digest"] for s in rank0["steps"]}) == len(rank0["steps"])  # the estimator learns every step
    assert any(a != 0 for s in rank0["steps"] for a in s["advantages"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINES)
def test_a_checkpoint_saved_under_the_engine_resumes_exactly(run, name):
    """The estimator's file is written once (by rank 0) per checkpoint, every rank reads it back, and the resumed
    step 3 is the uninterrupted run's, bit for bit."""
    rank0, rank1 = run(name)
    assert rank0["estimator_files"] == ["poise_estimator.safetensors"]
    assert (rank0["saves"], rank1["saves"]) == (len(rank0["checkpoints"]), 0)
    for rank in (rank0, rank1):
        resumed = rank["resumed"]
        assert resumed["global_step"] == 3 and len(resumed["steps"]) == 1  # step 3 generates a new batch
        assert resumed["loaded"] == rank0["steps"][-2]["digest"]  # what rank 0 saved at step 2
        assert resumed["steps"] == rank["steps"][-1:]


@pytest.mark.slow
def test_every_engine_sees_the_same_first_step(run):
    """Step 1's estimator (fitted on the gathered features of the untrained model) is identical under every engine:
    sharding changes where the weights live, not what POISE reads."""
    assert len({run(name)[0]["steps"][0]["digest"] for name in ENGINES}) == 1
