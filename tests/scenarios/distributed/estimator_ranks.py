"""Two gloo processes run one `POISEEstimator` each on the same batches, with rank 0's probe broadcast, and count
their device->host transfers per step (tests/scenarios/test_distributed.py). Not imported by the package.

    torchrun --nproc_per_node=2 tests/scenarios/distributed/estimator_ranks.py OUTPUT_DIR [history]

With "history", prompts repeat across steps and the estimator keeps their history (updated by every rank from the
same batch, never broadcast).
"""

import sys

import torch
import torch.distributed as dist

from poise_trl.estimator.estimator import POISEEstimator, Rollouts
from poise_trl.estimator.specs import BufferSpec, EstimatorSpec, HeadSpec, HistorySpec, LayerSpec
from tests.host_sync import HostSyncCounter
from tests.scenarios.distributed.rank_io import finish

dist.init_process_group("gloo")
rank = dist.get_rank()
HISTORY = len(sys.argv) > 2 and sys.argv[2] == "history"


def broadcast(tensor: torch.Tensor) -> torch.Tensor:
    dist.broadcast(tensor, src=0)
    return tensor


# Three candidate layers, re-chosen every 2 steps: the steps that choose a layer are counted apart.
spec = EstimatorSpec(
    head=HeadSpec(alpha=1.0),
    buffer=BufferSpec(warmup_steps=1),
    layers=LayerSpec(ids=(4, 8, 12), index=1, select_every=2, folds=2),
    history=HistorySpec() if HISTORY else None,
)
estimator = POISEEstimator(2, spec, broadcast=broadcast)
counts = []
for step in range(6):
    g = torch.Generator().manual_seed(step)  # the same batch on every rank, as after the trainer's gather
    x = torch.randn(16, 3, 6, generator=g)
    r = (torch.rand(16, generator=g) < torch.sigmoid(2 * x[:, 1, 0])).float()
    prompts = (torch.arange(16) // 2 + 3 * step) % 10 if HISTORY else torch.arange(16) // 2 + 100 * step
    counter = HostSyncCounter()
    with counter:
        result = estimator.advantages(x, Rollouts(r, prompt_ids=prompts))
        estimator.observe(result)
        result.metrics()
    counts.append({"step": step + 1, "transfers": counter.count, "calls": counter.calls})
state = estimator.state_dict()["tensors"]
finish(
    sys.argv[1],
    rank,
    {
        "world": dist.get_world_size(),
        "counts": counts,
        "probe": {k: v.tolist() for k, v in state.items() if "probe" in k},
        "history": {k: v.tolist() for k, v in state.items() if k.startswith("history.")},
    },
)
