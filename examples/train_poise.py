"""Train with POISE (or the GRPO/DAPO baseline) from a YAML recipe: `poise-trl train` as a script.

    accelerate launch --config_file configs/accelerate/zero3.yaml examples/train_poise.py \\
        --config configs/poise_qwen3_4b_dapo.yaml

The arguments are `poise-trl train`'s (see `poise_trl.rlvr.train`): `--config recipe.yaml`, then any field of the
recipe overridden on the command line.
"""

import sys

from poise_trl.rlvr.train import run

if __name__ == "__main__":
    sys.exit(run(prog="train_poise.py"))
