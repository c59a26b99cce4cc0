"""`bench overhead`'s peak memory: each contender trains in a fresh interpreter of its own, which reports its peak.

The worker's entry point is `python -m poise_lab.bench.overhead JSON` (the package's `__main__`).
"""

import gc
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..common import device_kind, quiet_libraries, ratio, set_cpu_threads
from .timing import OWN_PASS, PREFIX, Row, build_trainer, contenders, model_and_prompts


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
    """Run in a fresh process (`python -m poise_lab.bench.overhead JSON`): after one warm-up cycle, for each row,
    build the trainer, train a few cycles, and report its peak memory above what the process held when training
    started."""
    quiet_libraries()
    set_cpu_threads(settings["cpu_threads"])
    model, prompts = model_and_prompts(settings)
    # One untimed cycle first: lazily initialised libraries and allocator pools would otherwise land on row 1's peak.
    build_trainer(algorithm, rows[0], settings, 1, model, prompts).train()
    gc.collect()
    results = []
    for row in rows:
        trainer = build_trainer(algorithm, row, settings, settings["memory_cycles"], model, prompts)
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
    """Peak memory of each contender per row, each in a fresh interpreter of its own (JSON on stdout).

    With the tiny demo model on a CPU the processes run at once (they share nothing, and peaks are per process); on
    a GPU, or with `--model`, one after the other, so that copies of a large model never compete for its memory
    (three SmolLM2 trainers at 32 completions of 16 tokens would hold about 20 GB at once).
    """
    if device_kind() == "cpu" and not Path("/proc/self/clear_refs").exists():
        return [{"name": row.name, "skipped": "needs Linux /proc/self/clear_refs on CPU"} for row in rows]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # read by glibc at start: freed tensors leave the RSS
    measured: dict[str, list[dict[str, float]]] = {}
    processes = {}
    for algorithm in contenders(settings):
        payload = json.dumps({"algorithm": algorithm, "rows": [asdict(r) for r in rows], "settings": settings})
        command = [sys.executable, "-m", "poise_lab.bench.overhead", payload]
        log = Path(settings["output_dir"]) / f"memory_{algorithm}.log"  # a file: a full stderr pipe would stall it
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as stderr:
            processes[algorithm] = (subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr), log)
        if device_kind() == "cuda" or settings["model"] is not None:
            measured[algorithm] = _collect(algorithm, *processes[algorithm])
    for algorithm, (process, log) in processes.items():
        if algorithm not in measured:
            measured[algorithm] = _collect(algorithm, process, log)
    results = []
    for i, row in enumerate(rows):
        peaks = {algorithm: measured[algorithm][i] for algorithm in measured}
        result = {"name": row.name, **peaks, **_ratios(peaks["poise"], peaks["grpo"])}
        if PREFIX in peaks:
            result.update(
                {f"prefix_{k}": v for k, v in _ratios(peaks[PREFIX], peaks["grpo"]).items()},
                **{f"prefix_poise_{k}": v for k, v in _ratios(peaks[PREFIX], peaks["poise"]).items()},
            )
        if OWN_PASS in peaks:
            result.update({f"own_pass_{k}": v for k, v in _ratios(peaks[OWN_PASS], peaks["grpo"]).items()})
        results.append(result)
    return results


def _ratios(a: dict[str, float], b: dict[str, float]) -> dict[str, float | None]:
    """Peak over peak, and training peak (above what the process held at the start) over training peak."""
    return {
        "peak_ratio": ratio(a["peak_mib"], b["peak_mib"]),
        "training_peak_ratio": ratio(a["training_peak_mib"], b["training_peak_mib"]),
    }


def _collect(algorithm: str, process: subprocess.Popen, log: Path) -> list[dict[str, float]]:
    stdout, _ = process.communicate()
    if process.returncode:
        raise RuntimeError(f"the {algorithm} memory run failed ({log}):\n{log.read_text()[-4000:]}")
    return json.loads(stdout.decode().strip().splitlines()[-1])
