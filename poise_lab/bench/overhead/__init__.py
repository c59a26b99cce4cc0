"""`poise-trl bench overhead`, the implementation; the method is `bench.cli.overhead`, whose docstring is its `--help`.

Its parts: `timing` (alternated step times), `memory` (peak memory per contender, in fresh processes), `probe_fit`
(the probe's refit against scikit-learn); this module runs them and writes the report.
"""

import argparse
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poise_lab.models.real import is_real_model

from ..common import (
    ARITH_DATASET,
    environment,
    fmt,
    fmt_summary,
    format_table,
    quiet_libraries,
    ratio,
    set_cpu_threads,
    write_json,
)
from .memory import measure_memory
from .probe_fit import probe_fit_benchmark
from .timing import IMPORTANCE, OWN_PASS, PREFIX, Row, model_and_prompts, time_row

__all__ = ["format_report", "headline", "probe_fit_benchmark", "run_overhead"]


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
                fmt_summary(t["poise_cycle_seconds"]),
                fmt_summary(t["grpo_cycle_seconds"]),
                fmt_summary(t["time_ratio"]),
                str(t["extra_passes_observed"]),
                fmt_summary(t["poise_probe_fit_seconds_per_step"], 2),
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
        for name, head in p.get("heads", {}).items():
            gpu = f", GPU {head['torch_gpu_seconds']:.3f} s" if "torch_gpu_seconds" in head else ""
            ridge_gpu = f", GPU {p['torch_gpu_seconds']:.3f} s" if "torch_gpu_seconds" in p else ""
            rows.append(
                [
                    f"{name} head fit ({p['preset']})",
                    f"{head['torch_cpu_seconds']:.2f} (torch CPU{gpu})",
                    f"{p['torch_cpu_seconds']:.2f} (ridge{ridge_gpu})",
                    fmt(head["cpu_ratio_to_ridge"]) + (f" (GPU {fmt(head['gpu_ratio_to_ridge'])})" if gpu else ""),
                    "–",
                    "–",
                    "–",
                    "–",
                ]
            )
    tables = format_table(headers, rows)
    for variant in VARIANTS:
        if settings.get(variant.flag):
            tables += "\n\n" + variant_table(variant, timing, memory_by_name)
    return tables + "\n" + headline(timing, memory, probe, settings)


Cell = Callable[[dict, dict], str]  # a timing row and its memory row (empty without one) -> one cell


def _summary(key: str, digits: int = 3) -> Cell:
    return lambda t, m: fmt_summary(t[key], digits)


def _peak_mib(contender: str) -> Cell:
    return lambda t, m: f"{m[contender]['training_peak_mib']:.0f}" if contender in m else "–"


def _memory(key: str) -> Cell:
    return lambda t, m: fmt(m.get(key))


@dataclass(frozen=True)
class Variant:
    """A POISE variant timed beside GRPO and POISE (default) in the same alternated cycles and memory runs: the
    setting that adds it, the label of its rows, and its table's columns after "setting"."""

    flag: str
    label: str
    columns: tuple[tuple[str, Cell], ...]


VARIANTS = (
    Variant(
        "prefix",
        "per-prefix",
        (
            ("per-prefix s/cycle", _summary(f"{PREFIX}_cycle_seconds")),
            ("time ratio to GRPO", _summary("prefix_time_ratio")),
            ("time ratio to POISE", _summary("prefix_poise_time_ratio")),
            (
                "generations served / timed",
                lambda t, m: f"{t['prefix_served_generations']} / {t['prefix_timed_generations']}",
            ),
            ("peak MiB per-prefix", _peak_mib(PREFIX)),
            ("peak ratio to GRPO", _memory("prefix_training_peak_ratio")),
            ("peak ratio to POISE", _memory("prefix_poise_training_peak_ratio")),
        ),
    ),
    # The sampler's own seconds per cycle: `_select_prompts` (prefill, prompt-only refit, draw).
    Variant(
        "importance",
        "importance",
        (
            ("importance s/cycle", _summary(f"{IMPORTANCE}_cycle_seconds")),
            ("time ratio to GRPO", _summary("importance_time_ratio")),
            ("time ratio to POISE", _summary("importance_poise_time_ratio")),
            ("sampler s/cycle", _summary("importance_selection_seconds", 2)),
            ("sampler share of cycle", _summary("importance_selection_share", 2)),
            ("peak MiB importance", _peak_mib(IMPORTANCE)),
        ),
    ),
    # POISE on a no-grad pass of its own (`probe_capture="pass"`, the route before the loss's forward served).
    Variant(
        "capture_route",
        "own pass",
        (
            ("own pass s/cycle", _summary(f"{OWN_PASS}_cycle_seconds")),
            ("time ratio to GRPO", _summary("own_pass_time_ratio")),
            ("POISE (default) / own pass", _summary("poise_own_pass_time_ratio")),
            ("own passes/cycle", lambda t, m: str(t["own_pass_passes_observed"])),
            ("peak MiB own pass", _peak_mib(OWN_PASS)),
            ("peak ratio to GRPO", _memory("own_pass_training_peak_ratio")),
        ),
    ),
)


def variant_table(variant: Variant, timing: list[dict], memory_by_name: dict[str, dict]) -> str:
    """One row per timed setting: the variant's columns of its timing and memory rows."""
    headers = ["setting", *(header for header, _ in variant.columns)]
    rows = [
        [
            f"{t['name']} ({variant.label})",
            *(cell(t, memory_by_name.get(t["name"], {})) for _, cell in variant.columns),
        ]
        for t in timing
    ]
    return format_table(headers, rows)


def headline(timing: list[dict], memory: list[dict], probe: list[dict], settings: dict[str, Any]) -> str:
    parts = [f"{t['name']} ×{fmt(t['time_ratio']['median'])}" for t in timing]
    line = f"Summary: POISE/GRPO step time at G={settings['group_size']}: " + ", ".join(parts)
    peaks = [m["training_peak_ratio"] for m in memory if m.get("training_peak_ratio") is not None]
    if peaks:
        line += f"; training peak memory ×{fmt(min(peaks))}–×{fmt(max(peaks))}"
    if settings.get("prefix"):
        parts = [f"{t['name']} ×{fmt(t['prefix_time_ratio']['median'])}" for t in timing]
        line += "; per-prefix/GRPO: " + ", ".join(parts)
        parts = [f"{t['name']} ×{fmt(t['prefix_poise_time_ratio']['median'])}" for t in timing]
        line += "; per-prefix/POISE: " + ", ".join(parts)
    if settings.get("capture_route"):
        parts = [f"{t['name']} ×{fmt(t['own_pass_time_ratio']['median'])}" for t in timing]
        line += "; own pass/GRPO: " + ", ".join(parts)
    if settings.get("importance"):
        parts = [f"{t['name']} ×{fmt(t['importance_poise_time_ratio']['median'])}" for t in timing]
        line += "; importance/POISE: " + ", ".join(parts)
        parts = [f"{t['name']} {fmt(t['importance_selection_share']['median'])}" for t in timing]
        line += "; sampler share of its cycle: " + ", ".join(parts)
    for p in probe:
        if p["preset"] == "paper":
            line += (
                f"; probe fit {p['shape'][0]}×{p['shape'][1]} {p['torch_cpu_seconds']:.2f} s vs sklearn "
                f"{p['sklearn_seconds']:.2f} s"
            )
            if "torch_gpu_seconds" in p:
                line += f" (GPU {p['torch_gpu_seconds']:.3f} s)"
    return line + "."


def _relative_paths(settings: dict[str, Any], output_dir: Path) -> dict[str, str]:
    """The run's folders as overhead.json records them: relative to the run folder when inside it (it gets committed;
    this machine's absolute paths mean nothing elsewhere), as given otherwise."""
    run, shown = output_dir.resolve(), {}
    for key in ("output_dir", "cache_dir"):
        path = Path(settings[key]).resolve()
        shown[key] = str(path.relative_to(run)) if path.is_relative_to(run) else settings[key]
    return shown


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
    if args.model is not None and is_real_model(args.model) and args.train_dataset is None:
        args.train_dataset = ARITH_DATASET  # the task the real models are measured on
    output_dir = Path(args.output_dir)
    settings = {
        key: getattr(args, key)
        for key in (
            "completion_lengths",
            "layouts",
            "group_size",
            "completions_per_step",
            "per_device_batch_size",
            "cycles",
            "warmup_cycles",
            "memory_cycles",
            "learning_rate",
            "seed",
            "model",
            "train_dataset",
            "train_limit",
            "gradient_checkpointing",
            "cpu_threads",
            "probe_fit_rows",
            "probe_fit_hidden",
            "probe_fit_repeats",
            "probe_fit_heads",
            "prefix",
            "importance",
            "capture_route",
        )
    }
    settings.update(
        output_dir=str(output_dir),
        cache_dir=str(args.cache_dir or output_dir / "models"),
        thread_timeout=args.thread_timeout,
    )
    if args.model is not None and args.train_dataset is None:
        raise SystemExit("--model needs --train-dataset (its prompts)")
    rows = [Row(length, layout) for length in args.completion_lengths for layout in args.layouts]
    start = time.perf_counter()
    model, prompts = model_and_prompts(settings)  # prepares (and caches) the model once, before any worker reads it
    # The memory workers run first, while this process holds no trainer: with a real model, three trainers held here
    # beside the workers outgrew 24 GB, and the kernel killed the run after its timing.
    memory = [] if args.skip_memory else measure_memory(rows, settings)
    timing = []
    for row in rows:
        timing.append(time_row(row, settings, model, prompts))
        gc.collect()  # the row's trainers hold reference cycles; free them before the next row builds its own
        by_order = timing[-1]["time_ratio_by_order"]
        line = (
            f"[bench overhead] {row.name}: time ratio {fmt_summary(timing[-1]['time_ratio'])} (POISE first "
            f"{fmt_summary(by_order['poise_first'])}, GRPO first {fmt_summary(by_order['grpo_first'])})"
        )
        if args.prefix:
            line += (
                f"; per-prefix to GRPO {fmt_summary(timing[-1]['prefix_time_ratio'])}, to POISE "
                f"{fmt_summary(timing[-1]['prefix_poise_time_ratio'])}"
            )
        if args.importance:
            line += (
                f"; importance to POISE {fmt_summary(timing[-1]['importance_poise_time_ratio'])}, sampler "
                f"{fmt_summary(timing[-1]['importance_selection_seconds'])} s/cycle"
            )
        if args.capture_route:
            line += (
                f"; own pass to GRPO {fmt_summary(timing[-1]['own_pass_time_ratio'])}, POISE to own pass "
                f"{fmt_summary(timing[-1]['poise_own_pass_time_ratio'])}"
            )
        print(line, flush=True)
        if timing[-1]["extra_passes_observed"] != 0:
            print(f"  warning: POISE ran {timing[-1]['extra_passes_observed']} passes of its own per cycle, not 0")
    probe = (
        []
        if args.skip_probe_fit
        else probe_fit_benchmark(
            args.probe_fit_repeats, args.probe_fit_hidden, args.probe_fit_rows, args.probe_fit_heads
        )
    )
    report = format_report(timing, memory, probe, settings)
    path = write_json(
        output_dir / "overhead.json",
        {
            "command": "poise-trl bench overhead",
            "settings": {**settings, **_relative_paths(settings, output_dir)},
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
