"""Start multi-process test workers the way users do: torchrun or accelerate launch, on CPU with
gloo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)


def torchrun(nproc: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --standalone --nproc-per-node N args...`, one torch
    thread per worker, offline, with any outer launcher's rank variables removed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", *args]
    return subprocess.run(cmd, env=_worker_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def accelerate_launch(config: str, nproc: int, *args: str,
                      timeout: int = 600) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file CONFIG --num_processes N args...` in the same
    environment as `torchrun` (accelerate starts the workers through torchrun's launcher)."""
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch",
           "--config_file", config, "--num_processes", str(nproc), "--main_process_port", "0",
           *args]
    return subprocess.run(cmd, env=_worker_env(), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _worker_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1",
           # the workers import this checkout's hf_dsinfer, whatever is installed
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def exit_skipping_teardown() -> None:
    """End a torchrun test worker whose results are written, without interpreter finalization.

    About 1 gloo launch in 20 here (and twice in CI) a ProcessGroupGloo worker thread released a
    Python-owned tensor while the main thread was finalizing; Python ended that thread and the
    process aborted after all its work was done (see the exit hook in
    hf_dsinfer/parallel/groups.py, which makes this rare for users' scripts). Workers leave with
    os._exit so their exit status depends only on their results.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
