"""Names the docstring examples of ``muonfn`` use, for ``pytest --doctest-modules``."""

import pytest
import torch
from tensordict import TensorDict

import muonfn


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:
    doctest_namespace.update(torch=torch, TensorDict=TensorDict, muonfn=muonfn)
