"""Helpers for tests and demos that run real multi-process gloo jobs on one machine."""

from charm_megatron.testing.multiproc import RankFailure, run_ranks

__all__ = ["RankFailure", "run_ranks"]
