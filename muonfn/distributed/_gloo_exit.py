"""A workaround of torch's: gloo worker threads that abort the process at interpreter exit
(pytorch/pytorch#190489).

``destroy_process_group()`` does not stop a group's gloo worker threads while a
``DeviceMesh``, FSDP's state or a :class:`~muonfn.distributed.TorchCollectives` still
references the group, so they outlive the script. A worker that finished a collective
a moment before the interpreter started finalizing (a ``full_tensor()`` of the state dict,
say) may still be waiting for the GIL to drop its tensors; a thread that takes the GIL
then is ended inside a ``noexcept`` destructor: ``terminate called without an active
exception`` (SIGABRT), after every rank has finished its work. Measured on the teardown
script of the tests (4 ranks on 2 cores): 1 launch of 16 aborted without this hook, none
of 12 with it. Delete this module once torch stops the workers itself.
"""

from __future__ import annotations

import atexit
import functools
import glob
import os
import time

#: The name torch gives the worker threads of a gloo process group (``ProcessGroupGloo::runLoop``).
_GLOO_WORKER = "pt_gloo_runloop"


def _gloo_worker_runnable() -> bool:
    """Whether a gloo worker thread of this process is running or ready to run."""
    for path in glob.glob("/proc/self/task/*/stat"):
        try:
            with open(path) as f:
                stat = f.read()
        except OSError:
            continue  # the thread has ended
        # "tid (name) state ...": the name may hold spaces and parentheses, the state follows the last ")"
        end = stat.rfind(")")
        if stat[stat.find("(") + 1 : end] == _GLOO_WORKER and stat[end + 2 : end + 3] == "R":
            return True
    return False


def _wait_for_gloo_workers(timeout: float = 2.0, tick: float = 0.005) -> None:
    """Sleeps, releasing the GIL (so a waiting worker is woken and stays runnable until it is
    done), until no gloo worker is runnable two looks in a row, at most ``timeout`` s; without
    ``/proc`` to look at, one fixed grace period."""
    if not os.path.isdir("/proc/self/task"):
        time.sleep(11 * tick)
        return
    deadline = time.monotonic() + timeout
    idle_looks = 0
    while idle_looks < 2 and time.monotonic() < deadline:
        time.sleep(tick)
        idle_looks = 0 if _gloo_worker_runnable() else idle_looks + 1


@functools.cache
def settle_gloo_workers_at_exit() -> None:
    """Registers :func:`_wait_for_gloo_workers` to run at interpreter exit, once per process."""
    atexit.register(_wait_for_gloo_workers)
