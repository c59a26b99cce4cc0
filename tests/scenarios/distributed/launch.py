"""Launch a rank script on CPU processes (gloo) and judge what the ranks wrote, not the launcher's exit code alone.

gloo sometimes aborts a process at interpreter exit ("terminate called without an active exception") after training
and the results are complete; a 2-process plain `GRPOTrainer` run does it too. Each rank writes its results file
atomically as soon as training ends, before tearing the process group down, so a present file is a finished rank: a
launch fails when a rank's file is missing, and only warns when every rank finished and the launcher failed after.
"""

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).parents[3]  # the checkout under test, even where another copy is installed


def free_port() -> int:
    """A TCP port free on this host now, for one launch's rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(
    script: Path,
    args: list[str],
    out: Path,
    processes: int = 2,
    timeout: float = 1200,  # a hang's limit: a launch takes 10-40 s alone, several times that on shared cores
    accelerate: list[str] | None = None,
    env_vars: dict[str, str] | None = None,
) -> list[dict]:
    """Run `script args` on `processes` CPU processes; returns each rank's results (`rank{r}.json` in `out`). With
    `accelerate` (e.g. `["--config_file", "zero3.yaml"]`), through `accelerate launch` as a user would, else
    torchrun."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    if accelerate is not None:
        launcher = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            f"--num_processes={processes}",
            f"--main_process_port={free_port()}",  # not accelerate's fixed 29500: launches may run side by side
            *accelerate,
        ]
    python_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}
    env.update(env_vars or {})
    command = [*launcher, str(script), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    files = [out / f"rank{r}.json" for r in range(processes)]
    missing = [f.name for f in files if not f.exists()]
    assert not missing, f"exit code {result.returncode}, no results from {missing}:\n{result.stderr[-3000:]}"
    if result.returncode:
        warnings.warn(
            f"every rank wrote its results, then the launcher exited with {result.returncode} (teardown):\n"
            f"{result.stderr[-1500:]}",
            stacklevel=2,
        )
    ranks = [json.loads(f.read_text()) for f in files]
    assert all(r["world"] == processes for r in ranks)  # really `processes` processes, not one
    return ranks
