import os

# The suite's matrices are small, so one thread is as fast, and it is immune to oversubscription:
# on a busy 2-core machine OpenMP barriers spin while a thread waits for a core (the whole suite
# took 148 s with two threads and 35 s with one, at load average 7). Set through the environment
# too, so that subprocesses compute with the same thread count (bitwise comparisons depend on it).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from hypothesis import HealthCheck, settings

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Reproducible runs: no deadline (CI machines are noisy), derandomized examples.
settings.register_profile(
    "ci", deadline=None, derandomize=True, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
