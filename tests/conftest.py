import os
from collections.abc import Iterator

# The suite's matrices are small, so one thread is as fast, and it is immune to oversubscription:
# on a busy 2-core machine OpenMP barriers spin while a thread waits for a core (the whole suite
# took 148 s with two threads and 35 s with one, at load average 7). Set through the environment
# too, so that subprocesses compute with the same thread count (bitwise comparisons depend on it).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The default Newton–Schulz dtype on a CPU depends on its bf16 units; the suite pins the fp32 rule
# so that its results are the same on both kinds of CPU (subprocesses inherit it). The bf16
# default is tested explicitly (tests/test_newton_schulz.py), and tests needing bf16 ask for it.
os.environ.setdefault("MUONFN_CPU_NS_DTYPE", "float32")

import pytest
import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Reproducible runs: no deadline (CI machines are noisy), derandomized examples.
settings.register_profile(
    "ci", deadline=None, derandomize=True, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICE_ENV = "MUONFN_TEST_DEVICE"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default=None,
        help=f"device of the device-agnostic tests (the `device` fixture): cpu or cuda; default ${DEVICE_ENV} or cpu",
    )


def chosen_device(config: pytest.Config) -> torch.device:
    """The device the ``device`` fixture gives: ``--device``, else ``$MUONFN_TEST_DEVICE``, else CPU."""
    return torch.device(config.getoption("--device") or os.environ.get(DEVICE_ENV) or "cpu")


def pytest_configure(config: pytest.Config) -> None:
    # asking for a GPU that is not there is an error, not a silent run on the CPU
    device = chosen_device(config)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {device} (or ${DEVICE_ENV}) asks for CUDA, which is not available")


def pytest_report_header(config: pytest.Config) -> str:
    return f"muonfn test device: {chosen_device(config)}"


@pytest.fixture(scope="module")
def fp32_newton_schulz() -> Iterator[None]:
    """The fp32 CPU rule for a module whose tests check fp32 Newton–Schulz, also in a run that
    forces another (``MUONFN_CPU_NS_DTYPE=bfloat16``); the tests of the rule set their own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MUONFN_CPU_NS_DTYPE", "float32")
        yield


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> torch.device:
    """Where the device-agnostic tests put their tensors (``--device cuda`` or ``MUONFN_TEST_DEVICE=cuda``)."""
    return chosen_device(pytestconfig)


# a script that each rank of a torchrun launch runs (see _dist_harness.run_interpreters): importing
# it, as --doctest-modules would, starts a process group
collect_ignore = ["_teardown_script.py", "_cuda_collectives_script.py"]
