import os

from hypothesis import HealthCheck, settings

# Reproducible runs: no deadline (CI machines are noisy), derandomized examples.
settings.register_profile(
    "ci", deadline=None, derandomize=True, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
