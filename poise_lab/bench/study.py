"""The efficiency study around single runs: one small JSON per (task, contender, learning rate, seed), so a study
resumes where it stopped and its raw results can be committed; learning-rate tuning on seeds disjoint from the
evaluation seeds; then every contender at its own rate on the evaluation seeds, task after task.

The work is ordered so that what matters most finishes first: a task's tuning, then its evaluation seed by seed (all
contenders of one seed before the next, so partial results stay paired), then the next task.
"""

import json
import math
import multiprocessing
import os
import time
from collections.abc import Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, as_completed
from functools import partial
from pathlib import Path
from typing import Any

from .common import (
    ALPHA,
    environment,
    fmt,
    median,
    quiet_libraries,
    set_cpu_threads,
    smallest_p_holm,
)
from .contenders import CONTENDERS, Contender, paired_references
from .efficiency import run_one, task_factory
from .settings import EfficiencySettings
from .summary import normalized_auc
from .trainers import unavailable_reason

Job = tuple[str, float, int]  # (contender, learning rate, seed)


def run_path(results_dir: str | Path, task: str, name: str, learning_rate: float, seed: int) -> Path:
    return Path(results_dir) / "runs" / task / name / f"lr{learning_rate:g}_seed{seed}.json"


def load_runs(results_dir: str | Path) -> list[dict[str, Any]]:
    """Every finished run under `results_dir/runs`, in a stable order."""
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("runs/*/*/*.json"))]


def _write_atomic(path: Path, payload: dict[str, Any]) -> None:
    """A killed study leaves either the whole file or none, so a resume never reads half a run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1) + "\n")
    os.replace(tmp, path)


def check_identity(results_dir: Path, identity: dict[str, Any]) -> None:
    """Refuse to mix runs of different settings in one results directory (a resume must match the first launch):
    `identity` is the study's `EfficiencySettings.identity()`."""
    path = results_dir / "study.json"
    if path.exists():
        before = json.loads(path.read_text())["settings"]
        differ = {k: (before.get(k), v) for k, v in identity.items() if k != "warmup_steps" and before.get(k) != v}
        for task, steps in identity["warmup_steps"].items():
            if before.get("warmup_steps", {}).get(task, steps) != steps:
                differ[f"warmup_steps[{task}]"] = (before["warmup_steps"][task], steps)
        if differ:
            detail = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in differ.items())
            raise SystemExit(
                f"{results_dir} holds runs with other settings ({detail}); pass the same settings to "
                "resume, or another --output-dir"
            )
        identity = {**identity, "warmup_steps": {**before.get("warmup_steps", {}), **identity["warmup_steps"]}}
    _write_atomic(path, {"settings": identity})


def _worker_setup(cpu_threads: int) -> None:
    """Each worker process: its thread count and quiet libraries, once."""
    set_cpu_threads(cpu_threads)
    quiet_libraries()


def _run_in_worker(
    task: str, name: str, learning_rate: float, seed: int, settings: EfficiencySettings
) -> dict[str, Any]:
    """One run in a worker process; the seed's task is rebuilt there from its cached files."""
    contender = CONTENDERS[name]
    run = run_one(contender, seed, task_factory(settings, task)(seed), settings, learning_rate)
    role = "tune" if seed in settings.tuning_seeds else "eval"
    run.update(task=task, label=contender.label, trainer=contender.trainer, role=role, environment=environment())
    print(
        f"[bench efficiency] {task} {role} seed {seed} {contender.label} lr {learning_rate:g}: avg@{settings.eval_k} "
        f"{fmt(run['avg_at_k'][0])} -> {fmt(run['avg_at_k'][-1])}, {run['completions_generated']} generated, "
        f"{run['train_seconds']:.0f} s (+{run['eval_seconds']:.0f} s eval)",
        flush=True,
    )
    return run


class Study:
    """Runs jobs that have no result file yet, `settings.jobs` at a time, and writes each result as it finishes."""

    def __init__(self, settings: EfficiencySettings, pool: Executor):
        self.settings, self.pool = settings, pool
        self.results_dir = Path(settings.output_dir)

    def ensure(self, task: str, jobs: list[Job]) -> dict[Job, dict[str, Any]]:
        results, missing = {}, []
        for job in dict.fromkeys(jobs):
            path = run_path(self.results_dir, task, *job)
            if path.exists():
                results[job] = json.loads(path.read_text())
            else:
                missing.append(job)
        if not missing:
            return results
        make_task, prepared, futures = task_factory(self.settings, task), set(), {}
        for job in missing:  # warm starts are built here, one at a time, so workers only read the cache
            if job[2] not in prepared:
                make_task(job[2])
                prepared.add(job[2])
            future = self.pool.submit(_run_in_worker, task, *job, self.settings)
            # Written the moment it finishes, even while this loop still builds later seeds' warm starts.
            future.add_done_callback(partial(self._save, run_path(self.results_dir, task, *job)))
            futures[future] = job
        for future in as_completed(futures):
            results[futures[future]] = future.result()
        return results

    @staticmethod
    def _save(path: Path, future: Future) -> None:
        if not future.cancelled() and future.exception() is None:
            _write_atomic(path, future.result())


def tune(study: Study, task: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each contender's rate with the best median AUC over the tuning seeds; a best rate at the grid's edge extends
    the grid by a factor of 2 that way (at most `max_grid_extensions` times per contender)."""
    settings = study.settings
    grids = {name: sorted(settings.lr_grid) for name in names}
    extensions = dict.fromkeys(names, 0)
    while True:
        # Seed-major, so a study stopped midway has every contender and rate on the first tuning seeds.
        jobs = [
            (name, lr, seed)
            for seed in settings.tuning_seeds
            for lr in sorted({*sum(grids.values(), [])})
            for name in names
            if lr in grids[name]
        ]
        runs = study.ensure(task, jobs)
        tuned, extended = {}, False
        for name in names:
            table = [
                {
                    "learning_rate": lr,
                    "aucs": [
                        normalized_auc(runs[(name, lr, seed)], settings.budget) for seed in settings.tuning_seeds
                    ],
                }
                for lr in grids[name]
            ]
            for row in table:
                row["median_auc"] = median(row["aucs"])
            best = max(table, key=lambda row: row["median_auc"])["learning_rate"]
            at_edge = best in (grids[name][0], grids[name][-1])
            if at_edge and extensions[name] < settings.max_grid_extensions:
                grids[name].insert(0, best / 2) if best == grids[name][0] else grids[name].append(best * 2)
                extensions[name] += 1
                extended = True
            tuned[name] = {"learning_rate": best, "at_edge": at_edge, "table": table}
        if not extended:
            return tuned


def learning_rates(study: Study, task: str, contenders: list[Contender]) -> dict[str, Any]:
    """Per contender: its rate and how it was chosen (tuned, or for a one-change ablation the rate of the contender
    it changes)."""
    settings = study.settings
    names = [c.name for c in contenders]
    if not settings.tune_lr:
        return {name: {"learning_rate": settings.learning_rate, "source": "--learning-rate"} for name in names}
    ablations = {c.name: c.rate_of for c in contenders if c.rate_of is not None}
    if missing := sorted(set(ablations.values()) - set(names)):
        raise SystemExit(
            f"--tune-lr runs the ablations {', '.join(ablations)} at the tuned rate of the contender each changes: "
            f"add {' '.join(missing)} to --contenders"
        )
    tuned = tune(study, task, [name for name in names if name not in ablations])
    rates = {name: {**tuned[name], "source": "tuned"} for name in tuned}
    for name, parent in ablations.items():
        rates[name] = {"learning_rate": tuned[parent]["learning_rate"], "source": f"{parent}'s tuned rate"}
    path = study.results_dir / f"tuning_{task}.json"
    earlier = json.loads(path.read_text()) if path.exists() else {}  # a run of some contenders keeps the others'
    _write_atomic(path, {**earlier, "task": task, "tuning_seeds": settings.tuning_seeds, **rates})
    return rates


def available(names: Sequence[str]) -> list[Contender]:
    """The contenders this library version can run (each other one is reported, not run)."""
    contenders = []
    for name in names:
        reason = unavailable_reason(CONTENDERS[name])
        if reason is None:
            contenders.append(CONTENDERS[name])
        else:
            print(f"[bench efficiency] {CONTENDERS[name].label} unavailable, not run: {reason}", flush=True)
    return contenders


def validate(settings: EfficiencySettings, contenders: list[Contender]) -> None:
    """Bad settings fail here, before any run, with what to change."""
    for contender in contenders:
        if settings.completions_per_step % contender.group_size:
            raise SystemExit(
                f"--completions-per-step {settings.completions_per_step} is not a multiple of {contender.label}'s "
                "group"
            )
    if settings.budget < settings.completions_per_step or settings.eval_every <= 0:
        raise SystemExit("--budget must be at least --completions-per-step and --eval-every positive")
    if settings.train_limit is not None and settings.train_limit < 1:
        raise SystemExit(f"--train-limit {settings.train_limit}: train on at least one prompt (or leave it unset)")
    if settings.tune_lr:
        overlap = set(settings.tuning_seeds) & {s for task in settings.tasks for s in settings.eval_seeds(task)}
        if overlap:
            raise SystemExit(
                f"tuning and evaluation seeds overlap ({sorted(overlap)}): choose disjoint --seeds, "
                "--task-seeds and --tuning-seeds"
            )
        if len(settings.lr_grid) < 2 or any(not math.isfinite(lr) or lr <= 0 for lr in settings.lr_grid):
            raise SystemExit("--lr-grid needs at least two positive rates")
    headline = [c.name for c in contenders if c.headline]
    names = {c.name for c in contenders}
    tests = 2 * sum(ref in names for name in headline for ref in paired_references(name)) * len(settings.tasks)
    for task in settings.tasks:
        seeds = len(settings.eval_seeds(task))
        if tests and (floor := smallest_p_holm(seeds, tests)) >= ALPHA:
            print(
                f"[bench efficiency] warning: {task} has {seeds} evaluation seeds; across {tests} headline tests "
                f"no Holm-corrected p-value can fall below {floor:.2g}, so no verdict can be decided: run more "
                "seeds (--seeds, --task-seeds)",
                flush=True,
            )


def run_study(settings: EfficiencySettings) -> dict[str, dict[str, Any]]:
    """Every task's tuning and evaluation runs, skipping those already on disk; returns the rates per task."""
    contenders = available(settings.contenders)
    if not contenders:
        raise SystemExit("no contender can run with this library version")
    validate(settings, contenders)
    results_dir = Path(settings.output_dir)
    check_identity(results_dir, settings.identity())
    context = multiprocessing.get_context("spawn")  # no worker inherits this process's thread pools
    setup = dict(mp_context=context, initializer=_worker_setup, initargs=(settings.cpu_threads,))
    rates: dict[str, dict[str, Any]] = {}
    start = time.perf_counter()
    with ProcessPoolExecutor(max(1, settings.jobs), **setup) as pool:
        study = Study(settings, pool)
        for task in settings.tasks:
            rates[task] = learning_rates(study, task, contenders)
            for seed in settings.eval_seeds(task):
                study.ensure(task, [(c.name, rates[task][c.name]["learning_rate"], seed) for c in contenders])
                print(f"[bench efficiency] {task}: seed {seed} done ({time.perf_counter() - start:.0f} s)", flush=True)
    return rates
