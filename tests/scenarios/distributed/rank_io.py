"""What a rank script does once training ends: write its results atomically, then tear the process group down."""

import json
import os
from pathlib import Path

import torch


def finish(out: str, rank: int, results: dict) -> None:
    """`rank{rank}.json` appears complete or not at all (the launcher reads it as "this rank finished"); then every
    rank meets at a barrier before the group is destroyed, so no rank closes its connections while a peer still uses
    them."""
    path = Path(out) / f"rank{rank}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(results))
    os.replace(partial, path)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
