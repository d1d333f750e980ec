"""Runs a function on ``W`` gloo processes, forked from a server that has already imported torch.

Importing torch takes seconds; forking a preloaded server takes milliseconds, so every
world size can get its own group of processes. A worker that raises makes the run raise
with its traceback, and the other workers are terminated; a collective that waits longer
than ``COLLECTIVE_TIMEOUT`` fails instead of hanging.

Forked workers leave through ``os._exit``, skipping interpreter finalization, so they
cannot show a crash at exit; :func:`run_interpreters` launches a script as real
interpreters, repeatedly, for that.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import multiprocessing.forkserver
import os
import pathlib
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "tensordict",
    "muonfn",
    "muonfn.distributed",
    "_dist_models",
    "_dist_workers",
]
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server() -> None:
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    # the server, and so every worker, runs without dynamo (start-up); this process keeps its environment
    previous = os.environ.get("TORCHDYNAMO_DISABLE")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["TORCHDYNAMO_DISABLE"]
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = previous


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, payload: bytes) -> None:
    torch.set_num_threads(1)  # W processes share two cores
    args = torch.load(io.BytesIO(payload), weights_only=False)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run(fn: Callable[..., None], world_size: int, *args: Any) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` processes with a gloo default group."""
    _start_server()
    # tensors travel as bytes: multiprocessing would pass each storage as a file descriptor
    payload = io.BytesIO()
    torch.save(args, payload)
    mp.start_processes(
        _entry, args=(fn, world_size, free_port(), payload.getvalue()), nprocs=world_size, start_method="forkserver"
    )


def run_interpreters(script: pathlib.Path, world_size: int, repeats: int = 3, timeout: float = 180) -> None:
    """``torchrun --nproc_per_node world_size script``, ``repeats`` times; every launch must exit 0.

    Each rank is a fresh interpreter that exits through interpreter finalization, so a
    crash after the work is done (a thread that outlives the process group, say) fails
    the test; such crashes are races, hence the repeats. torchrun exits non-zero when any
    rank does and names the rank and the signal.
    """
    root = pathlib.Path(__file__).resolve().parents[1]
    # the environment of a user's torchrun (dynamo enabled), which makes the crash at exit likelier
    env = {k: v for k, v in os.environ.items() if k != "TORCHDYNAMO_DISABLE"}
    env.update(PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for launch in range(1, repeats + 1):
        args = ["--nproc_per_node", str(world_size), "--master_port", str(free_port()), str(script)]
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, (
            f"{script.name} on {world_size} ranks, launch {launch} of {repeats}: exit status {done.returncode}\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
