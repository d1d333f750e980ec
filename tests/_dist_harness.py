"""Runs a function on ``W`` gloo processes, forked from a server that has already imported torch.

Importing torch takes seconds; forking a preloaded server takes milliseconds, so every
world size can get its own group of processes. A worker that raises makes the run raise
with its traceback, and the other workers are terminated; a collective that waits longer
than ``COLLECTIVE_TIMEOUT`` fails instead of hanging.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing
import multiprocessing.forkserver
import os
import socket
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
