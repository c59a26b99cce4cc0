"""Profile one trainer (POISE or GRPO) of `bench overhead`'s "TRL default" layout on SmolLM2, in a process of its own.

The trainer is `bench overhead`'s own (`timing.build_trainer`: same config, prompts, forced completion length, and
POISE's buffer filled to 4,096 rows after the first step); `--warmup` steps are left out of the summary. Per step:
process CPU seconds (user + system, all threads), wall seconds, minor page faults, context switches, Python GC
time; per piece (methods of TRL and POISE wrapped here, also named in torch.profiler traces): CPU seconds, calls and
minor page faults. Pieces are inclusive (a nested piece also counts in its parent). One thread: on a shared machine
the CPU time of two OpenMP threads counts their spinning while the other waits, and varies with the load.

From the repository root (PYTHONPATH=.):
    OMP_NUM_THREADS=1 python benchmarks/real-lm/overhead-profile/profile_step.py poise 16 --steps 4 --threads 1 \
        --tag _t1 --torch-profile --out benchmarks/real-lm/overhead-profile
    OMP_NUM_THREADS=1 python benchmarks/real-lm/overhead-profile/profile_step.py grpo 64 --per-device-batch-size 8 \
        --steps 4 --threads 1 --tag _t1 --out benchmarks/real-lm/overhead-profile
    python benchmarks/real-lm/overhead-profile/compare.py POISE.json GRPO.json
"""

import argparse
import functools
import gc
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback
from trl import GRPOTrainer

import poise_trl.estimator.batch as batch_module
import poise_trl.estimator.buffer as buffer_module
import poise_trl.estimator.estimator as estimator_module
import poise_trl.estimator.learner as learner_module
import poise_trl.features.capture as capture_module
import poise_trl.features.features as features_module
import poise_trl.grpo.step as step_module
import poise_trl.grpo.trainer as trainer_module
import poise_trl.heads.probe as probe_module
from poise_lab.bench.common import quiet_libraries, set_cpu_threads
from poise_lab.bench.overhead.timing import Row, build_trainer, model_and_prompts


class Ledger:
    def __init__(self):
        self.totals = defaultdict(lambda: [0.0, 0.0, 0, 0])  # cpu, wall, calls, minflt

    def wrap(self, owner, name, label=None):
        label = label or f"{getattr(owner, '__name__', owner)}.{name}"
        original = getattr(owner, name)
        ledger = self

        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            c0, w0 = time.process_time(), time.perf_counter()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                with torch.profiler.record_function(label):
                    return original(*args, **kwargs)
            finally:
                entry = ledger.totals[label]
                entry[0] += time.process_time() - c0
                entry[1] += time.perf_counter() - w0
                entry[2] += 1
                entry[3] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0

        setattr(owner, name, wrapped)

    def snapshot(self):
        return {k: list(v) for k, v in self.totals.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("algorithm", choices=["poise", "grpo", "poise_pass"])
    parser.add_argument("length", type=int)
    parser.add_argument("--per-device-batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=6, help="profiled steps after the 2 warm-up steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--torch-profile", action="store_true", help="torch.profiler over the last profiled step")
    parser.add_argument("--out", default=".")
    parser.add_argument("--tag", default="")
    parser.add_argument("--toy", action="store_true", help="the demo model on sort prompts instead of SmolLM2")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    quiet_libraries()
    set_cpu_threads(args.threads)
    settings = dict(
        per_device_batch_size=args.per_device_batch_size,
        completions_per_step=32,
        group_size=2,
        learning_rate=1e-5,
        seed=0,
        model=None if args.toy else "smollm2-135m",
        train_dataset=None if args.toy else "arith",
        train_limit=None,
        gradient_checkpointing=False,
        output_dir="runs/profile-step",
        cache_dir="runs/profile-step/models",
    )
    ledger = Ledger()
    # TRL's pieces, in both trainers
    ledger.wrap(Trainer, "training_step", "step/training_step")
    ledger.wrap(GRPOTrainer, "_prepare_inputs", "step/_prepare_inputs")
    ledger.wrap(GRPOTrainer, "_generate_and_score_completions", "gen/_generate_and_score_completions(TRL)")
    ledger.wrap(GRPOTrainer, "_generate", "gen/_generate")
    ledger.wrap(GRPOTrainer, "_calculate_rewards", "gen/_calculate_rewards")
    ledger.wrap(GRPOTrainer, "_compute_loss", "loss/_compute_loss(TRL)")
    ledger.wrap(GRPOTrainer, "_get_per_token_logps_and_entropies", "loss/forward(TRL logps)")
    ledger.wrap(torch.optim.AdamW, "step", "opt/AdamW.step")
    if args.algorithm != "grpo":
        P = trainer_module.POISETrainer
        ledger.wrap(P, "_generate_and_score_completions", "poise/_generate_and_score_completions(all)")
        ledger.wrap(P, "_select_prompts", "poise/_select_prompts")
        ledger.wrap(P, "_track_spans", "poise/_track_spans")
        ledger.wrap(P, "_domain_names", "poise/_domain_names")
        ledger.wrap(trainer_module, "prompt_group_ids", "poise/prompt_group_ids")
        ledger.wrap(trainer_module, "shuffle_groups", "poise/shuffle_groups")
        ledger.wrap(P, "_capture_micro_batch", "poise/_capture_micro_batch(incl forward)")
        ledger.wrap(P, "_feature_pass", "poise/_feature_pass(own pass)")
        ledger.wrap(features_module.PooledCapture, "__call__", "poise/hook PooledCapture")
        ledger.wrap(capture_module.PassCapture, "result", "poise/PassCapture.result")
        ledger.wrap(features_module.FeatureSpans, "rows", "poise/FeatureSpans.rows")
        ledger.wrap(step_module.GenerationStep, "inputs_for", "poise/GenerationStep.inputs_for")
        ledger.wrap(step_module.GenerationStep, "assemble", "poise/GenerationStep.assemble")
        ledger.wrap(P, "_observe", "poise/_observe")
        E = estimator_module.POISEEstimator
        ledger.wrap(E, "advantages", "est/advantages")
        ledger.wrap(E, "prepare", "est/prepare")
        ledger.wrap(E, "_probe_values", "est/_probe_values")
        ledger.wrap(E, "observe", "est/observe")
        ledger.wrap(estimator_module, "bootstrap_lines", "est/bootstrap_lines")
        ledger.wrap(learner_module.OnlineLearner, "added", "learn/OnlineLearner.added")
        ledger.wrap(learner_module.OnlineLearner, "fitted", "learn/OnlineLearner.fitted (refit)")
        ledger.wrap(buffer_module.ProbeBuffer, "add", "learn/ProbeBuffer.add")
        ledger.wrap(buffer_module.ProbeBuffer, "_ordered", "learn/ProbeBuffer._ordered")
        ledger.wrap(probe_module.ScaledHead, "fit", "probe/fit")
        ledger.wrap(probe_module.ScaledHead, "_fit_front", "probe/_fit_front")
        ledger.wrap(probe_module, "_principal_axes", "probe/_principal_axes")
        ledger.wrap(probe_module.ScaledHead, "_project", "probe/_project")
        ledger.wrap(probe_module.ValueProbe, "_solve", "probe/_solve")
        ledger.wrap(probe_module.ScaledHead, "predict", "probe/predict")
        ledger.wrap(batch_module.AdvantageResult, "metrics", "est/result.metrics")
        ledger.wrap(P, "_selection_metrics", "poise/_selection_metrics")

    gc_state = {"start": 0.0, "wall": 0.0, "cpu": 0.0, "cpu_start": 0.0, "count": [0, 0, 0]}

    def gc_callback(phase, info):
        if phase == "start":
            gc_state["start"], gc_state["cpu_start"] = time.perf_counter(), time.process_time()
        else:
            gc_state["wall"] += time.perf_counter() - gc_state["start"]
            gc_state["cpu"] += time.process_time() - gc_state["cpu_start"]
            gc_state["count"][info["generation"]] += 1

    gc.callbacks.append(gc_callback)
    model, prompts = model_and_prompts(settings)
    row = Row(args.length, "default")
    total_steps = args.warmup + args.steps
    trainer = build_trainer(args.algorithm, row, settings, total_steps, model, prompts)

    records = []

    class StepProbe(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.c0, self.w0 = time.process_time(), time.perf_counter()
            self.r0 = resource.getrusage(resource.RUSAGE_SELF)
            self.l0 = ledger.snapshot()
            self.g0 = (gc_state["cpu"], list(gc_state["count"]))
            if args.torch_profile and state.global_step == total_steps - 1:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.prof.__enter__()

        def on_step_end(self, a, state, control, **kw):
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            rec = {
                "step": state.global_step,
                "cpu": time.process_time() - self.c0,
                "wall": time.perf_counter() - self.w0,
                "utime": r1.ru_utime - self.r0.ru_utime,
                "stime": r1.ru_stime - self.r0.ru_stime,
                "minflt": r1.ru_minflt - self.r0.ru_minflt,
                "nvcsw": r1.ru_nvcsw - self.r0.ru_nvcsw,
                "nivcsw": r1.ru_nivcsw - self.r0.ru_nivcsw,
                "maxrss_mib": r1.ru_maxrss / 1024,
                "pieces": {},
                "gc_cpu": gc_state["cpu"] - self.g0[0],
                "gc_collections": [a - b for a, b in zip(gc_state["count"], self.g0[1], strict=True)],
            }
            l1 = ledger.snapshot()
            for k, v in l1.items():
                before = self.l0.get(k, [0.0, 0.0, 0, 0])
                d = [v[i] - before[i] for i in range(4)]
                if d[2]:
                    rec["pieces"][k] = {"cpu": d[0], "wall": d[1], "calls": d[2], "minflt": d[3]}
            records.append(rec)
            print(
                f"step {rec['step']}: cpu {rec['cpu']:.2f} (u {rec['utime']:.2f} s {rec['stime']:.2f}) wall "
                f"{rec['wall']:.2f} minflt {rec['minflt']} load {open('/proc/loadavg').read().split()[0]}",
                flush=True,
            )
            if getattr(self, "prof", None) is not None:
                self.prof.__exit__(None, None, None)
                tag = f"{args.algorithm}_{args.length}{args.tag}"
                Path(args.out).mkdir(parents=True, exist_ok=True)
                table = self.prof.key_averages().table(sort_by="cpu_time_total", row_limit=80)
                Path(args.out, f"torchprof_{tag}.txt").write_text(table)
                self.prof = None

    trainer.add_callback(StepProbe())
    trainer.train()
    timed = records[args.warmup :]
    summary = {"args": vars(args), "records": records}
    tag = f"{args.algorithm}_{args.length}{args.tag}"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"profile_{tag}.json").write_text(json.dumps(summary, indent=1))
    keys = sorted({k for r in timed for k in r["pieces"]})
    n = len(timed)
    print(f"\n== {tag}: {n} profiled steps (after {args.warmup} warm-up)")
    for field in ("cpu", "utime", "stime", "wall", "minflt", "gc_cpu"):
        vals = [r[field] for r in timed]
        print(f"  step {field}: mean {sum(vals) / n:.3f}  min {min(vals):.3f}  max {max(vals):.3f}")
    print(f"  {'piece':55s} {'cpu s/step':>10s} {'wall s/step':>11s} {'calls/step':>10s} {'minflt/step':>11s}")
    for k in keys:
        cpu = sum(r["pieces"].get(k, {}).get("cpu", 0) for r in timed) / n
        wall = sum(r["pieces"].get(k, {}).get("wall", 0) for r in timed) / n
        calls = sum(r["pieces"].get(k, {}).get("calls", 0) for r in timed) / n
        flt = sum(r["pieces"].get(k, {}).get("minflt", 0) for r in timed) / n
        print(f"  {k:55s} {cpu:10.4f} {wall:11.4f} {calls:10.1f} {flt:11.0f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
