"""The training demo behind ``charm-megatron demo`` / ``make demo`` (``docs/demo.md``).

* :mod:`~charm_megatron.train_demo.runner` - :func:`run_demo`: the link (emulated cluster or
  loopback), the training job, the Megatron-LM logs, ``compare`` and the loss check.
* :mod:`~charm_megatron.train_demo.train` - what every rank runs: megatron-core's GPTModel with
  CHARM+ attention, mock data, DDP gradient all-reduce, AdamW, Megatron's LR schedule.
* :mod:`~charm_megatron.train_demo.megatron_log` - Megatron-LM's log line formats.
* :mod:`~charm_megatron.train_demo.cpu_megatron` - the few redirections megatron-core needs on a
  CPU-only torch.

Importing this package imports neither torch nor Megatron.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_demo"]


def run_demo(*args: Any, **kwargs: Any) -> Any:
    """See :func:`charm_megatron.train_demo.runner.run_demo`."""
    from charm_megatron.train_demo.runner import run_demo as _run_demo

    return _run_demo(*args, **kwargs)
