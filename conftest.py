"""Names the docstring examples of ``muonfn`` use, for ``pytest --doctest-modules``; and, loaded
before anything imports torch, the inductor cache of a run under another ATen CPU capability."""

import getpass
import os
import tempfile

# A run under another ATen CPU capability (ATEN_CPU_CAPABILITY=default: no AVX kernels) must not
# load the inductor kernels cached for this CPU's own, which do not build there ("'at::vec' has not
# been declared"): it gets a cache of its own, one per capability (subprocesses inherit it). Set
# here, first: importing tensordict fixes inductor's cache folder.
if capability := os.environ.get("ATEN_CPU_CAPABILITY"):
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        user = "unknown"
    # beside inductor's own default, torchinductor_<user>
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{user}_{capability}")
    )

import pytest
import torch
from tensordict import TensorDict

import muonfn


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, TensorDict=TensorDict, muonfn=muonfn)
