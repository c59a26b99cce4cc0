"""How hard is each `arith` family for a model? Held-out avg@k and the share of prompts with mixed outcomes.

POISE and GRPO learn only from prompts whose rollouts disagree (or, for POISE, whose probe predicts a value strictly
between the outcomes), so a useful task mix has many prompts with mixed outcomes at the start and stays hard once
the answer format is learned. This measures both per family; run it on the start model and on a briefly trained one:

    python examples/arith_families.py smollm2-135m --output benchmarks/real-lm/arith-families-start.json
    poise-trl demo --model smollm2-135m --output-dir runs/demo-real
    python examples/arith_families.py runs/demo-real/final --output benchmarks/real-lm/arith-families-trained.json
"""

import argparse
import json
import time
from pathlib import Path

from poise_lab.models.real import resolve_model
from poise_lab.models.toy import evaluate_avg_at_k, load_demo_model
from poise_lab.tasks.arith import ARITH_MAX_COMPLETION_LENGTH, FAMILIES, arith_reward, make_arith_splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a real model's name (smollm2-135m) or a model folder")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--prompts", type=int, default=48, help="held-out prompts per family")
    parser.add_argument("--k", type=int, default=8, help="samples per prompt")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    parser.add_argument("--seed", type=int, default=0, help="split and sampling seed")
    parser.add_argument("--output", default=None, help="JSON file for the table (default: print only)")
    args = parser.parse_args()

    model, tokenizer = load_demo_model(resolve_model(args.model, log=print))
    rows = {}
    for name in args.families:
        _, held_out = make_arith_splits(num_train=10, num_eval=args.prompts, seed=args.seed, families=[name])
        start = time.perf_counter()
        result = evaluate_avg_at_k(
            model,
            tokenizer,
            held_out,
            k=args.k,
            max_new_tokens=ARITH_MAX_COMPLETION_LENGTH,
            batch_size=args.batch_size,
            seed=args.seed,
            reward=arith_reward,
        )
        rates = result["per_prompt"]
        rows[name] = {
            "description": FAMILIES[name].description,
            "avg_at_k": result["avg_at_k"],
            "mixed": sum(0 < rate < 1 for rate in rates) / len(rates),
            "all_wrong": sum(rate == 0 for rate in rates) / len(rates),
            "all_right": sum(rate == 1 for rate in rates) / len(rates),
            "seconds": time.perf_counter() - start,
        }
        row = rows[name]
        shares = f"mixed {row['mixed']:.0%}, all wrong {row['all_wrong']:.0%}, all right {row['all_right']:.0%}"
        print(f"{name:>9}: avg@{args.k} {row['avg_at_k']:.3f}, {shares} ({row['seconds']:.0f} s)", flush=True)
    if args.output:
        payload = {"model": args.model, "prompts_per_family": args.prompts, "k": args.k, "seed": args.seed}
        Path(args.output).write_text(json.dumps({**payload, "families": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
