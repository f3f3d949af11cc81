"""Shared test settings: bounded communication waits and hypothesis profiles."""

import os

from hypothesis import settings

# A broken collective must fail a test in seconds, not hang CI.
os.environ.setdefault("CHARM_COMM_TIMEOUT_S", "60")

settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True)
settings.load_profile("ci")
