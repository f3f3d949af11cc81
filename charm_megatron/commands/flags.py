"""The command-line flags shared by ``charm-megatron plan``, ``model`` and ``bench``: a
problem's size (:func:`add_problem_args` / :func:`problem_from_args`) and one flag per registered
algorithm setting, made from its declaration (:func:`add_setting_args` /
:func:`settings_from_args`). Here, not in the plan layer, so that the plan layer parses no
command line; ``roles`` is a setting like any other (no flag of its own)."""

from __future__ import annotations

import argparse
from collections.abc import Collection

from charm_megatron.plan.cost import Problem
from charm_megatron.plan.registry import Values, all_settings, settings_values
from charm_megatron.plan.vocab import Dtype

ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def add_problem_args(parser: argparse.ArgumentParser) -> None:
    """The problem-size options shared by ``charm-megatron plan`` and ``model``."""
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=131072, help="global sequence length")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--v-head-dim", type=int, default=None,
                        help="v (and output) head dim, e.g. 128 for MLA's 192 / 128; default: "
                             "--head-dim")
    parser.add_argument("--dtype", choices=sorted(ELEM_BYTES), default="bf16")
    parser.add_argument("--window", type=parse_window, default=None, metavar="LEFT[,RIGHT]",
                        help="sliding window (flash-attn's window_size): query i sees keys "
                             "i-LEFT .. i+RIGHT (-1: unbounded; RIGHT defaults to 0); plans "
                             "then hold only the tiles and messages it needs")
    add_partials_arg(parser)


def add_partials_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--partials", choices=[d.value for d in Dtype], default="input",
                        help="the dtype partial results (out, dq, dkv) travel in: input "
                             "(default) or fp32 (CPOptions.partials; ring-flash-attention's "
                             "and the paper's ring send gradient partials in fp32)")


def parse_window(text: str) -> tuple[int, int]:
    """``"LEFT"`` or ``"LEFT,RIGHT"`` as ``(left, right)`` (``-1``: unbounded)."""
    parts = text.split(",")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or any(v < -1 for v in values):
        raise argparse.ArgumentTypeError(
            f"--window {text!r}: give LEFT or LEFT,RIGHT as integers >= -1 (-1: unbounded)")
    return (values[0], values[1] if len(values) == 2 else 0)


def problem_from_args(args: argparse.Namespace, seq: int | None = None) -> Problem:
    """The :class:`Problem` those options describe (``seq`` overrides ``--seq``)."""
    dv = getattr(args, "v_head_dim", None)
    window = getattr(args, "window", None)
    return Problem(args.batch, args.seq if seq is None else seq, args.heads,
                   args.kv_heads or args.heads, args.head_dim, ELEM_BYTES[args.dtype],
                   0 if dv in (None, args.head_dim) else dv,
                   None if window in (None, (-1, -1)) else tuple(window),
                   Dtype(getattr(args, "partials", "input")) is Dtype.FP32)


def add_setting_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     names: Collection[str] | None = None) -> None:
    """A flag per registered setting (``names``: only those), made from its declaration. These
    commands time no plans, so a setting left to the model (``auto``) is off: an on / off
    setting takes one of its values, and its bare flag means on; any other takes a value.
    Unset flags are ``None``: the setting's default (:func:`settings_from_args`)."""
    for s in all_settings().values():
        if names is not None and s.name not in names:
            continue
        env = f" (cp_attention: {s.env})" if s.env else ""
        if s.switch:
            parser.add_argument(s.flag, dest=s.name, nargs="?", const="on", default=None,
                                choices=s.choices,
                                help=f"{s.help}; the bare flag turns it on{env}")
        else:
            parser.add_argument(s.flag, dest=s.name, choices=s.choices, default=None,
                                help=f"{s.help}{env}")


def add_split_args(parser: argparse.ArgumentParser) -> None:
    """The flags forcing CHARM+'s row splits on (``split_visiting``,
    ``split_counterpart_q``, ``split_diagonal``), shared by ``charm-megatron plan`` and
    ``model``."""
    add_setting_args(parser, ("split_visiting", "split_counterpart_q", "split_diagonal"))


def settings_from_args(args: argparse.Namespace) -> dict[str, object]:
    """The settings the command line sets, by name (unset flags left out)."""
    return {name: getattr(args, name) for name in all_settings()
            if getattr(args, name, None) is not None}


def values_from_args(args: argparse.Namespace) -> Values:
    """Every setting's value: the command line's, the defaults for the rest."""
    return settings_values(**settings_from_args(args))
