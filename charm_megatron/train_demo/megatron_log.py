"""Megatron-LM's log lines, written by the training demo so that ``charm-megatron compare`` (and
any tool that reads Megatron-LM logs) reads them unchanged.

The formats are those of Megatron-LM ``core_v0.16.1`` (``megatron/training/training.py``,
``training_log``; ``megatron/training/arguments.py``, ``_print_args``).

The demo leaves out ``throughput per GPU (TFLOP/s/GPU)`` (as Megatron-LM does without
``--log-throughput``): Megatron prints it with one decimal, and a tiny model on CPU cores rounds
to 0.0.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["IterationRecord", "argument_dump", "format_iteration", "padded_vocab_size"]


@dataclass
class IterationRecord:
    """What ``training_log`` prints for one iteration (``log_interval`` 1); ``None`` fields are
    left out of the line."""

    iteration: int
    train_iters: int
    consumed_samples: int
    elapsed_ms: float
    learning_rate: float
    global_batch_size: int
    lm_loss: float
    grad_norm: float
    throughput_tflops: float | None = None
    loss_scale: float = 1.0
    skipped: int = 0
    nan: int = 0
    timestamp: str = ""


def format_iteration(r: IterationRecord) -> str:
    """One ``training_log`` line, character for character as Megatron-LM prints it (fp32 has
    no loss scaler, so ``loss scale`` is 1.0; Megatron omits ``lm loss`` when it is not > 0)."""
    stamp = r.timestamp or datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    s = f" [{stamp}]"
    s += f" iteration {r.iteration:8d}/{r.train_iters:8d} |"
    s += f" consumed samples: {r.consumed_samples:12d} |"
    s += f" elapsed time per iteration (ms): {r.elapsed_ms:.1f} |"
    if r.throughput_tflops is not None:
        s += f" throughput per GPU (TFLOP/s/GPU): {r.throughput_tflops:.1f} |"
    s += f" learning rate: {r.learning_rate:.6E} |"
    s += f" global batch size: {r.global_batch_size:5d} |"
    if r.lm_loss > 0.0:
        s += " {}: {:.6E} |".format("lm loss", r.lm_loss)
    s += f" loss scale: {r.loss_scale:.1f} |"
    s += f" grad norm: {r.grad_norm:.3f} |"
    s += f" number of skipped iterations: {r.skipped:3d} |"
    s += f" number of nan iterations: {r.nan:3d} |"
    return s


def argument_dump(args: Mapping[str, Any]) -> str:
    """Megatron-LM's start-up argument dump (``_print_args``), which ``compare`` reads for labels
    (``cp_comm_type``, ``seq_length``, ``global_batch_size``)."""
    lines = ["------------------------ arguments ------------------------"]
    for key in sorted(args, key=lambda k: k.lower()):
        dots = "." * (48 - len(key))
        lines.append(f"  {key} {dots} {args[key]}")
    lines.append("-------------------- end of arguments ---------------------")
    return "\n".join(lines)


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round up to a multiple of
    ``divisible_by * tp`` (``--make-vocab-size-divisible-by``, default 128)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple
