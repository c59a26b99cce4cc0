"""POISE's and GRPO's profiles (profile_step.py's JSON) side by side: CPU seconds per step and per piece over the
profiled steps, and POISE's own work, piece by piece.

    python benchmarks/real-lm/overhead-profile/compare.py profile_poise_64_t1.json profile_grpo_64_t1.json
"""

import json
import sys
from statistics import mean


def piece(record: dict, name: str) -> float:
    return record["pieces"].get(name, {}).get("cpu", 0.0)


# POISE's own work: the pieces POISE wraps around TRL's, less the TRL piece inside them.
OWN_WORK = {
    "the refit (the learner's fit: scaler, PCA, ridge)": lambda r: piece(r, "learn/OnlineLearner.fit (refit)"),
    "  of which the PCA blocks' randomized SVD": lambda r: piece(r, "probe/_principal_axes"),
    "the rest of _observe (gather, the batch's advantages, buffers, bootstrap line, transfer, metrics)": lambda r: (
        piece(r, "poise/_observe") - piece(r, "learn/OnlineLearner.fit (refit)")
    ),
    "each micro-batch's capture (hooks and pooling, entropy statistics, advantages written)": lambda r: (
        piece(r, "poise/_capture_micro_batch(incl forward)") - piece(r, "loss/forward(TRL logps)")
    ),
    "  of which the hooks' pooling": lambda r: piece(r, "poise/hook PooledCapture"),
    "  of which estimator.advantages (every call, _observe's included)": lambda r: piece(r, "est/advantages"),
    "generation bookkeeping (spans, prompt ids, the estimator's inputs)": lambda r: (
        piece(r, "poise/_generate_and_score_completions(all)") - piece(r, "gen/_generate_and_score_completions(TRL)")
    ),
    "the whole-group shuffle": lambda r: piece(r, "poise/shuffle_groups"),
}


def main() -> None:
    poise, grpo = (json.load(open(path)) for path in sys.argv[1:3])
    warmup = poise["args"]["warmup"]
    P, G = poise["records"][warmup:], grpo["records"][warmup:]
    print(f"profiled steps: POISE {[r['step'] for r in P]}, GRPO {[r['step'] for r in G]}")
    for field in ("cpu", "utime", "stime", "minflt", "nvcsw", "nivcsw"):
        p, g = mean(r[field] for r in P), mean(r[field] for r in G)
        diffs = [round(a[field] - b[field], 2) for a, b in zip(P, G, strict=True)]
        change = f"{p - g:+10.3f} ({(p / g - 1) * 100:+.2f}%)"
        print(f"step {field:7s} POISE {p:12.3f}  GRPO {g:12.3f}  diff {change}  per step {diffs}")
    print(f"{'piece':50s} {'POISE cpu':>10s} {'GRPO cpu':>10s} {'diff':>8s} {'POISE flt':>10s} {'GRPO flt':>10s}")
    for name in sorted({k for r in P + G for k in r["pieces"]}):
        p, g = mean(piece(r, name) for r in P), mean(piece(r, name) for r in G)
        faults = [mean(r["pieces"].get(name, {}).get("minflt", 0) for r in R) for R in (P, G)]
        print(f"{name:50s} {p:10.4f} {g:10.4f} {p - g:+8.4f} {faults[0]:10.0f} {faults[1]:10.0f}")
    for label, R in (("POISE", P), ("GRPO", G)):
        outside = mean(r["cpu"] - piece(r, "step/training_step") - piece(r, "poise/_observe") for r in R)
        backward = mean(
            piece(r, "step/training_step") - piece(r, "step/_prepare_inputs") - piece(r, "loss/_compute_loss(TRL)")
            for r in R
        )
        print(f"{label}: optimizer, clipping, scheduler, callbacks {outside:.3f}; backward {backward:.3f}")
    step = mean(r["cpu"] for r in P)
    print("\nPOISE's own work, CPU s/step (share of POISE's step):")
    total = 0.0
    for name, work in OWN_WORK.items():
        value = mean(work(r) for r in P)
        total += 0.0 if name.startswith("  ") else value
        print(f"  {name:100s} {value:8.4f}  {value / step * 100:6.3f}%")
    print(f"  {'total':100s} {total:8.4f}  {total / step * 100:6.3f}%")


if __name__ == "__main__":
    main()
