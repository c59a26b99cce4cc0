"""`poise-trl bench overhead`, the implementation; the method is `bench.OVERHEAD_DESCRIPTION` (`--help`)."""

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from poise_trl.config import POISEConfig
from poise_trl.demo.model import prepare_demo_model
from poise_trl.demo.tasks import make_sort_splits
from poise_trl.features import block_sizes, pca_blocks
from poise_trl.probe import ValueProbe
from poise_trl.rlvr.data import load_math_dataset
from poise_trl.trainer import POISETrainer

from .common import (
    PROBE_FIT_ROWS,
    QWEN3_4B_HIDDEN,
    device_kind,
    environment,
    fmt,
    fmt_spread,
    format_table,
    quiet_libraries,
    ratio,
    set_cpu_threads,
    spread,
    trainer_device_args,
    write_json,
)


def any_text_reward(completions: list, **kwargs: Any) -> list[float]:
    """Fraction of digits in the completion: defined for any text, so forced-length completions are all scored."""
    texts = [c if isinstance(c, str) else "".join(str(m["content"]) for m in c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


@dataclass(frozen=True)
class Row:
    """One timed setting: forced completion length and whether POISE needs a forward pass of its own."""

    completion_length: int
    extra_passes: int  # 1: POISE runs its own feature pass; 0: it captures inside TRL's old-log-prob pass

    @property
    def steps_per_cycle(self) -> int:
        return 1 if self.extra_passes else 2

    @property
    def name(self) -> str:
        return f"{self.completion_length} tok, +{self.extra_passes} pass"


def _config(algorithm: str, row: Row, settings: dict[str, Any], max_steps: int, output_dir: str):
    """Both trainers' config; `--per-device-batch-size` micro-batches with gradient accumulation, so a real model's
    completions per optimizer step stay `--completions-per-step` without holding them all in one forward pass."""
    per_device = settings["per_device_batch_size"] or settings["completions_per_step"]
    accumulation = settings["completions_per_step"] // per_device
    common = dict(
        output_dir=output_dir,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        # Generation once per cycle: +1 pass, one optimizer step (TRL needs no old log-probs); +0 pass, two (it does).
        steps_per_generation=row.steps_per_cycle * accumulation,
        num_generations=settings["group_size"],
        max_steps=max_steps,
        learning_rate=settings["learning_rate"],
        lr_scheduler_type="constant",
        epsilon_high=0.28,
        beta=0.0,
        loss_type="dapo",
        max_completion_length=row.completion_length,
        generation_kwargs={"min_new_tokens": row.completion_length},
        seed=settings["seed"],
        **trainer_device_args(settings["gradient_checkpointing"]),
    )
    if algorithm == "poise":
        return POISEConfig(**common)
    return GRPOConfig(**common)


def _model_and_prompts(settings: dict[str, Any]) -> tuple[str, Dataset]:
    """The model and prompts: the warm-started demo model on sort prompts, or `--model` on `--train-dataset`."""
    if settings["model"] is None:
        path = prepare_demo_model(settings["cache_dir"], seed=settings["seed"])
        train, _ = make_sort_splits(seed=settings["seed"])
        return str(path), train
    return settings["model"], load_math_dataset(settings["train_dataset"], limit=settings["train_limit"])


def _build(algorithm: str, row: Row, settings: dict[str, Any], cycles: int, model: str, prompts: Dataset):
    trainer_class = POISETrainer if algorithm == "poise" else GRPOTrainer
    output_dir = str(Path(settings["output_dir"]) / "runs" / f"{algorithm}_{row.completion_length}_{row.extra_passes}")
    trainer = trainer_class(
        model=model,
        reward_funcs=any_text_reward,
        args=_config(algorithm, row, settings, cycles * row.steps_per_cycle, output_dir),
        train_dataset=prompts,
    )
    trainer.remove_callback(PrinterCallback)
    if algorithm == "poise":
        trainer.add_callback(SteadyStateProbe(trainer, row.steps_per_cycle))
    return trainer


def fill_probe_buffer(trainer: POISETrainer) -> None:
    """Repeat the buffered rows up to the buffer's capacity, so each refit costs what it costs in steady state."""
    buffer = trainer.probe_buffer
    missing = buffer.capacity - len(buffer)
    if missing <= 0 or len(buffer) == 0:
        return
    index = torch.arange(missing) % len(buffer)
    extra = {} if buffer.groups is None else {"groups": buffer.groups[index]}
    buffer.add(buffer.features[index], buffer.targets[index], **extra)


class SteadyStateProbe(TrainerCallback):
    """After the first generation cycle, fill POISE's probe buffer to capacity (untimed; that cycle is warm-up)."""

    def __init__(self, trainer: POISETrainer, steps_per_cycle: int):
        self.trainer, self.steps_per_cycle = trainer, steps_per_cycle

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.steps_per_cycle:
            fill_probe_buffer(self.trainer)


class Baton:
    """Turn-taking between trainer threads: each runs one cycle while the others wait; all start together."""

    def __init__(self, parties: int, timeout: float):
        self._condition = threading.Condition()
        self._parties, self._timeout = parties, timeout
        self._arrived, self._turn = 0, 0
        self._finished = [False] * parties
        self._aborted = False

    def arrive(self, me: int) -> None:
        with self._condition:
            self._arrived += 1
            self._condition.notify_all()
        self.wait_turn(me)

    def wait_turn(self, me: int) -> None:
        with self._condition:
            ready = self._condition.wait_for(
                lambda: self._aborted or (self._arrived == self._parties and self._turn == me), self._timeout
            )
            if self._aborted:
                raise RuntimeError("another benchmark thread failed")
            if not ready:
                raise TimeoutError(f"thread {me} waited more than {self._timeout} s for its turn")

    def pass_on(self, me: int, finished: bool) -> None:
        with self._condition:
            self._finished[me] = self._finished[me] or finished
            waiting = [(me + i) % self._parties for i in range(1, self._parties + 1)]
            self._turn = next((p for p in waiting if not self._finished[p]), me)
            self._condition.notify_all()

    def abort(self) -> None:
        with self._condition:
            self._aborted = True
            self._condition.notify_all()


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class CycleTimer(TrainerCallback):
    """Times each generation cycle (`steps_per_cycle` optimizer steps) of one trainer, taking turns via a Baton."""

    def __init__(self, baton: Baton, me: int, steps_per_cycle: int, trainer: Any):
        self.baton, self.me, self.steps_per_cycle, self.trainer = baton, me, steps_per_cycle, trainer
        self.seconds: list[float] = []
        self.feature_passes: list[int] = []
        self._start = 0.0
        self._passes = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.baton.arrive(self.me)

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_cycle == 0:
            _synchronize()
            self._passes = getattr(self.trainer, "feature_passes", 0)
            self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.steps_per_cycle:
            return
        _synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        self.feature_passes.append(getattr(self.trainer, "feature_passes", 0) - self._passes)
        finished = state.global_step >= state.max_steps
        self.baton.pass_on(self.me, finished)
        if not finished:
            self.baton.wait_turn(self.me)

    def on_train_end(self, args, state, control, **kwargs):
        self.baton.pass_on(self.me, finished=True)


def time_row(row: Row, settings: dict[str, Any], model: str, prompts: Dataset) -> dict[str, Any]:
    """POISE and GRPO alternate cycle by cycle; returns per-cycle times and their paired ratios."""
    cycles = settings["warmup_cycles"] + settings["cycles"]
    trainers = {name: _build(name, row, settings, cycles, model, prompts) for name in ("poise", "grpo")}
    baton = Baton(len(trainers), timeout=settings["thread_timeout"])
    timers = {}
    for me, (name, trainer) in enumerate(trainers.items()):
        timers[name] = CycleTimer(baton, me, row.steps_per_cycle, trainer)
        trainer.add_callback(timers[name])
    errors: list[BaseException] = []

    def train(trainer: Any) -> None:
        try:
            trainer.train()
        except BaseException as error:  # re-raised in the main thread below
            errors.append(error)
            baton.abort()

    threads = [threading.Thread(target=train, args=(t,), name=f"bench-{n}") for n, t in trainers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    skip = settings["warmup_cycles"]
    poise, grpo = (timers[name].seconds[skip:] for name in ("poise", "grpo"))
    passes = timers["poise"].feature_passes[skip:]
    timed_steps = [h for h in trainers["poise"].state.log_history if "poise/probe_fit_seconds" in h]
    timed_steps = timed_steps[skip * row.steps_per_cycle :]
    return {
        "row": asdict(row),
        "name": row.name,
        "poise_seconds": poise,
        "grpo_seconds": grpo,
        "poise_feature_passes_per_cycle": passes,
        "time_ratio": spread(p / g for p, g in zip(poise, grpo, strict=True)),
        "poise_cycle_seconds": spread(poise),
        "grpo_cycle_seconds": spread(grpo),
        "extra_passes_observed": max(passes) if passes else None,
        "poise_probe_fit_seconds_per_step": spread(h["poise/probe_fit_seconds"] for h in timed_steps),
    }


def _reset_peak() -> float:
    """Start a peak measurement; returns the memory held now in MiB (GPU: allocated; CPU: resident set)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    return _proc_status_mib("VmRSS")


def _peak() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() / 2**20
    return _proc_status_mib("VmHWM")


def _proc_status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_worker(algorithm: str, rows: list[Row], settings: dict[str, Any]) -> list[dict[str, float]]:
    """Run in a fresh process (`python -m poise_trl.bench.overhead JSON`): after one warm-up cycle, for each row,
    build the trainer, train a few cycles, and report its peak memory above what the process held when training
    started."""
    quiet_libraries()
    set_cpu_threads(settings["cpu_threads"])
    model, prompts = _model_and_prompts(settings)
    # One untimed cycle first: lazily initialised libraries and allocator pools would otherwise land on row 1's peak.
    _build(algorithm, rows[0], settings, 1, model, prompts).train()
    gc.collect()
    results = []
    for row in rows:
        trainer = _build(algorithm, row, settings, settings["memory_cycles"], model, prompts)
        gc.collect()
        start = _reset_peak()
        trainer.train()
        peak = _peak()
        results.append({"start_mib": start, "peak_mib": peak, "training_peak_mib": peak - start})
        del trainer  # the next row's start is measured without it
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def measure_memory(rows: list[Row], settings: dict[str, Any]) -> list[dict[str, Any]]:
    """Peak memory of POISE and GRPO per row, each contender in a fresh interpreter of its own (JSON on stdout).

    On a CPU the two processes run at once (they share nothing, and peaks are per process); on a GPU one after the
    other, so that two copies of a large model never compete for its memory.
    """
    if device_kind() == "cpu" and not Path("/proc/self/clear_refs").exists():
        return [{"name": row.name, "skipped": "needs Linux /proc/self/clear_refs on CPU"} for row in rows]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # read by glibc at start: freed tensors leave the RSS
    measured: dict[str, list[dict[str, float]]] = {}
    processes = {}
    for algorithm in ("poise", "grpo"):
        payload = json.dumps({"algorithm": algorithm, "rows": [asdict(r) for r in rows], "settings": settings})
        command = [sys.executable, "-m", "poise_trl.bench.overhead", payload]
        log = Path(settings["output_dir"]) / f"memory_{algorithm}.log"  # a file: a full stderr pipe would stall it
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as stderr:
            processes[algorithm] = (subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr), log)
        if device_kind() == "cuda":
            measured[algorithm] = _collect(algorithm, *processes[algorithm])
    for algorithm, (process, log) in processes.items():
        if algorithm not in measured:
            measured[algorithm] = _collect(algorithm, process, log)
    return [
        {
            "name": row.name,
            "poise": measured["poise"][i],
            "grpo": measured["grpo"][i],
            "peak_ratio": ratio(measured["poise"][i]["peak_mib"], measured["grpo"][i]["peak_mib"]),
            "training_peak_ratio": ratio(
                measured["poise"][i]["training_peak_mib"], measured["grpo"][i]["training_peak_mib"]
            ),
        }
        for i, row in enumerate(rows)
    ]


def _collect(algorithm: str, process: subprocess.Popen, log: Path) -> list[dict[str, float]]:
    stdout, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"the {algorithm} memory run failed ({log}):\n{log.read_text()[-4000:]}")
    return json.loads(stdout.decode().strip().splitlines()[-1])


def _probe_data(rows: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden-state-like features and a binary target that depends on them, so the fit has something to find.

    Each d-wide block is a 128-dim latent with a decaying spectrum (scale 1/j) plus weak noise, as hidden states
    are: its top principal components are well separated, so two PCA solvers agree on them and the predictions can
    be compared (with a flat noise floor, components past the signal would be arbitrary). 3 entropy-like columns.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    rank = 128
    latent = torch.randn(rows, rank, generator=g) / torch.arange(1, rank + 1)
    mixing = [torch.randn(rank, hidden, generator=torch.Generator().manual_seed(block)) for block in range(2)]
    blocks = [latent @ m + 0.01 * torch.randn(rows, hidden, generator=g) for m in mixing]
    entropy = torch.rand(rows, 3, generator=g) + latent[:, :3].abs()
    x = torch.cat([*blocks, entropy], dim=1)
    y = (latent[:, 0] + 0.5 * torch.randn(rows, generator=g) > 0).float()
    return x, y


def _median_seconds(fn: Callable[[], Any], repeats: int, sync: bool = False) -> float:
    times = []
    for _ in range(repeats):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return spread(times)["median"]


def probe_fit_benchmark(repeats: int, hidden: int = QWEN3_4B_HIDDEN, rows: int = PROBE_FIT_ROWS) -> list[dict]:
    """ValueProbe vs scikit-learn on the same (rows, 2*hidden + 3) data, same thread count, for both presets."""
    import numpy as np
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.linear_model import Ridge
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from threadpoolctl import threadpool_limits

    from poise_trl.config import PROBE_PRESETS

    blocks = ["prompt", "reasoning", "entropy"]
    x, y = _probe_data(rows, hidden)
    x_new, _ = _probe_data(512, hidden, seed=1)
    x64, y64, x_new64 = x.double().numpy(), y.double().numpy(), x_new.double().numpy()
    results = []
    for preset in ("paper", "release"):
        alpha, dims = PROBE_PRESETS[preset]
        pca = pca_blocks(blocks, hidden, dims)
        probe = ValueProbe(alpha=alpha, pca_dims=pca or None, clip=None)
        torch_seconds = _median_seconds(partial(probe.fit, x, y), repeats)
        ours = probe.predict(x_new).double().numpy()
        steps = [StandardScaler()]
        if pca:
            transformers = [(f"pca{i}", PCA(k, random_state=0), list(range(a, b))) for i, (a, b, k) in enumerate(pca)]
            steps.append(ColumnTransformer(transformers, remainder="passthrough"))
        reference = make_pipeline(*steps, Ridge(alpha=alpha))
        with threadpool_limits(limits=torch.get_num_threads()):
            sklearn_seconds = _median_seconds(partial(reference.fit, x64, y64), repeats)
        theirs = reference.predict(x_new64)
        result = {
            "preset": preset,
            "alpha": alpha,
            "pca_blocks": pca,
            "shape": [rows, int(sum(block_sizes(blocks, hidden).values()))],
            "threads": torch.get_num_threads(),
            "torch_cpu_seconds": torch_seconds,
            "sklearn_seconds": sklearn_seconds,
            "max_abs_prediction_difference": float(np.abs(ours - theirs).max()),
            "prediction_correlation": float(np.corrcoef(ours, theirs)[0, 1]),
            "prediction_std": float(theirs.std()),
        }
        if torch.cuda.is_available():
            gpu_probe, x_gpu, y_gpu = ValueProbe(alpha=alpha, pca_dims=pca or None, clip=None), x.cuda(), y.cuda()
            gpu_probe.fit(x_gpu, y_gpu)  # warm-up: CUDA context, cuSOLVER handles
            result["torch_gpu_seconds"] = _median_seconds(partial(gpu_probe.fit, x_gpu, y_gpu), repeats, sync=True)
        results.append(result)
    return results


def format_report(timing: list[dict], memory: list[dict], probe: list[dict], settings: dict[str, Any]) -> str:
    headers = [
        "setting",
        "POISE s/cycle",
        "GRPO s/cycle",
        "time ratio median [min, max]",
        "POISE passes/cycle",
        "POISE refit s/step",
        "peak MiB POISE / GRPO",
        "peak ratio",
    ]
    memory_by_name = {m["name"]: m for m in memory}
    rows = []
    for t in timing:
        m = memory_by_name.get(t["name"], {})
        peaks = "–"
        if "poise" in m:
            peaks = f"{m['poise']['training_peak_mib']:.0f} / {m['grpo']['training_peak_mib']:.0f}"
        rows.append(
            [
                t["name"],
                fmt_spread(t["poise_cycle_seconds"]),
                fmt_spread(t["grpo_cycle_seconds"]),
                fmt_spread(t["time_ratio"]),
                str(t["extra_passes_observed"]),
                fmt_spread(t["poise_probe_fit_seconds_per_step"], 2),
                peaks,
                fmt(m.get("training_peak_ratio")),
            ]
        )
    for p in probe:
        gpu = f", GPU {p['torch_gpu_seconds']:.3f} s" if "torch_gpu_seconds" in p else ""
        rows.append(
            [
                f"probe fit {p['shape'][0]}×{p['shape'][1]} ({p['preset']})",
                f"{p['torch_cpu_seconds']:.2f} (torch CPU{gpu})",
                f"{p['sklearn_seconds']:.2f} (sklearn)",
                fmt(ratio(p["torch_cpu_seconds"], p["sklearn_seconds"])),
                "–",
                "–",
                f"max |Δpred| {p['max_abs_prediction_difference']:.1e}",
                "–",
            ]
        )
    return format_table(headers, rows) + "\n" + headline(timing, memory, probe, settings)


def headline(timing: list[dict], memory: list[dict], probe: list[dict], settings: dict[str, Any]) -> str:
    parts = [f"{t['name']} ×{fmt(t['time_ratio']['median'])}" for t in timing]
    line = f"Summary: POISE/GRPO step time at G={settings['group_size']}: " + ", ".join(parts)
    peaks = [m["training_peak_ratio"] for m in memory if m.get("training_peak_ratio") is not None]
    if peaks:
        line += f"; training peak memory ×{fmt(min(peaks))}–×{fmt(max(peaks))}"
    for p in probe:
        if p["preset"] == "paper":
            line += (
                f"; probe fit {p['shape'][0]}×{p['shape'][1]} {p['torch_cpu_seconds']:.2f} s vs sklearn "
                f"{p['sklearn_seconds']:.2f} s"
            )
            if "torch_gpu_seconds" in p:
                line += f" (GPU {p['torch_gpu_seconds']:.3f} s)"
    return line + "."


def run_overhead(args: argparse.Namespace) -> int:
    """Handler of `poise-trl bench overhead`."""
    quiet_libraries()
    set_cpu_threads(args.cpu_threads)
    if args.completions_per_step % args.group_size:
        raise SystemExit("--completions-per-step must be a multiple of --group-size")
    if args.per_device_batch_size is not None and args.completions_per_step % args.per_device_batch_size:
        raise SystemExit("--completions-per-step must be a multiple of --per-device-batch-size")
    if args.gradient_checkpointing is None:
        args.gradient_checkpointing = args.model is not None  # a real model's activations need it (OOM otherwise)
    output_dir = Path(args.output_dir)
    settings = {
        key: getattr(args, key)
        for key in (
            "completion_lengths", "extra_passes", "group_size", "completions_per_step", "per_device_batch_size",
            "cycles", "warmup_cycles",
            "memory_cycles", "learning_rate", "seed", "model", "train_dataset", "train_limit",
            "gradient_checkpointing", "cpu_threads", "probe_fit_rows", "probe_fit_hidden", "probe_fit_repeats",
        )
    }  # fmt: skip
    settings.update(
        output_dir=str(output_dir),
        cache_dir=str(args.cache_dir or output_dir / "models"),
        thread_timeout=args.thread_timeout,
    )
    if args.model is not None and args.train_dataset is None:
        raise SystemExit("--model needs --train-dataset (its prompts)")
    rows = [Row(length, passes) for length in args.completion_lengths for passes in args.extra_passes]
    start = time.perf_counter()
    model, prompts = _model_and_prompts(settings)
    timing = []
    for row in rows:
        timing.append(time_row(row, settings, model, prompts))
        print(f"[bench overhead] {row.name}: time ratio {fmt_spread(timing[-1]['time_ratio'])}", flush=True)
        if timing[-1]["extra_passes_observed"] != row.extra_passes:
            print(
                f"  warning: POISE ran {timing[-1]['extra_passes_observed']} passes per cycle, not {row.extra_passes}"
            )
    memory = [] if args.skip_memory else measure_memory(rows, settings)
    probe = (
        []
        if args.skip_probe_fit
        else probe_fit_benchmark(args.probe_fit_repeats, args.probe_fit_hidden, args.probe_fit_rows)
    )
    report = format_report(timing, memory, probe, settings)
    path = write_json(
        output_dir / "overhead.json",
        {
            "command": "poise-trl bench overhead",
            "settings": settings,
            "environment": environment(),
            "wall_seconds": time.perf_counter() - start,
            "timing": timing,
            "memory": memory,
            "memory_method": "torch.cuda.max_memory_allocated"
            if torch.cuda.is_available()
            else "Linux VmHWM (peak RSS) reset after trainer construction, MALLOC_MMAP_THRESHOLD_=65536",
            "probe_fit": probe,
            "headline": report.splitlines()[-1],
        },
    )
    print(f"wrote {path}\n")
    print(report)  # its last line is the one-line summary
    return 0


if __name__ == "__main__":  # the memory worker's entry point, see measure_memory
    request = json.loads(sys.argv[1])
    rows = [Row(**row) for row in request["rows"]]
    print(json.dumps(memory_worker(request["algorithm"], rows, request["settings"])))
