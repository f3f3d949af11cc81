"""The ranks of a ``cp_attention`` call agree on it before any data moves, and report how it
went after.

Agreement: each rank packs its :class:`Signature` (shapes, dtype, algorithm, topology, mask,
scale, plan, options; or the error its own checks raised) into one small int64 vector; one
exchange on the CP group's gloo control group (one all-to-all round) gives every rank every
rank's vector, so every rank reaches the same verdict and raises the same error, naming the field and the ranks. Status:
after the plan ran (or raised), one more exchange of one number per rank tells every rank
whether any rank failed and whether the communicators must be rebuilt.

Fields are ``(name, value)`` pairs; adding one (e.g. packed-sequence lengths) is one more entry
in :func:`signature_fields`; values are hashed to int64 when they are not ints.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Status codes of the after-call exchange.
OK, RAISED, BROKEN = 0, 1, 2
_MSG_BYTES = 1000  # error path only
MAX_FIELDS = 48


class CPAttentionError(RuntimeError):
    """A ``cp_attention`` call failed on some rank (raised on every rank of the CP group)."""


class CPMismatchError(CPAttentionError, ValueError):
    """The ranks of a ``cp_attention`` call disagree on its inputs or settings."""


def _code(value) -> int:
    """An int64 standing for ``value`` (ints as themselves, everything else hashed)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and -(2 ** 62) < value < 2 ** 62:
        return value
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    digest = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return struct.unpack("<q", digest)[0]


@dataclass(frozen=True)
class Signature:
    """What one rank is about to do: ordered ``(field, value)`` pairs, or its local error."""

    fields: tuple[tuple[str, object], ...]
    error: str = ""  # this rank's own check failed: "TypeName: message"

    def vector(self) -> torch.Tensor:
        """``[error?, number of fields, codes...]`` padded to a fixed width (one exchange)."""
        if len(self.fields) > MAX_FIELDS:
            raise ValueError(f"a signature holds at most {MAX_FIELDS} fields")
        codes = [1 if self.error else 0, len(self.fields)] + [_code(v) for _, v in self.fields]
        return torch.tensor(codes + [0] * (MAX_FIELDS + 2 - len(codes)), dtype=torch.int64)


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup, size: int,
                timeout_s: float, what: str) -> list[torch.Tensor]:
    # Every rank's tensor to every rank in ONE round of an all-to-all, not gloo's all_gather:
    # that one is a ring of size - 1 sequential steps, each a network latency (and, with more
    # ranks than cores, a scheduling delay). Measured on 8 gloo ranks sharing 2 cores, 50
    # int64: all_gather 11.7-15.0 ms wall and 1.4-1.9 ms CPU per rank; all_to_all_single 3.9 ms
    # and 0.5 ms. Two of these run per cp_attention call.
    flat = t.reshape(-1)
    out = torch.empty(size * flat.numel(), dtype=t.dtype)
    try:
        work = dist.all_to_all_single(out, flat.repeat(size), group=group, async_op=True)
        work.wait(_timeout(timeout_s))
    except Exception as exc:  # noqa: BLE001 - re-raised with what it means
        raise CPAttentionError(
            f"cp_attention: the {what} exchange of the CP group did not complete within "
            f"{timeout_s:.0f} s ({type(exc).__name__}: {exc}). Likely causes: a rank died or "
            "stopped calling cp_attention, or ranks make different numbers of cp_attention "
            "calls; the CP group's communicators are rebuilt from the CP group at the next "
            "call") from exc
    return [row.reshape(t.shape) for row in out.chunk(size)]


def _pack_message(text: str) -> torch.Tensor:
    raw = text.encode("utf-8", "replace")[:_MSG_BYTES]
    buf = torch.zeros(_MSG_BYTES + 2, dtype=torch.uint8)
    buf[:2] = torch.tensor([len(raw) // 256, len(raw) % 256], dtype=torch.uint8)
    if raw:
        buf[2:2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return buf


def _unpack_message(buf: torch.Tensor) -> str:
    n = int(buf[0]) * 256 + int(buf[1])
    return bytes(buf[2:2 + n].tolist()).decode("utf-8", "replace")


def _messages(text: str, group, size: int, timeout_s: float) -> list[str]:
    got = _all_gather(_pack_message(text), group, size, timeout_s, "error-message")
    return [_unpack_message(b) for b in got]


def agree(sig: Signature, group: dist.ProcessGroup, size: int, timeout_s: float,
          local_error: BaseException | None = None) -> None:
    """Raise on every rank unless every rank has the same signature and no local error.

    A rank whose own checks failed re-raises its own exception (the others raise
    :class:`CPMismatchError` quoting it), so an input error keeps its type and message."""
    vec = sig.vector()
    if size == 1:
        if local_error is not None:
            raise local_error
        return
    rows = _all_gather(vec, group, size, timeout_s, "agreement")
    table = torch.stack(rows)
    if local_error is None and bool((table == vec).all()):
        return  # the common case: one comparison, no per-field work
    failed = [r for r, row in enumerate(rows) if int(row[0])]
    if failed:
        texts = _messages(sig.error, group, size, timeout_s)
        if local_error is not None:
            raise local_error
        detail = "; ".join(f"rank {r}: {texts[r]}" for r in failed)
        raise CPMismatchError(f"cp_attention: the call failed its input checks on "
                              f"{_ranks(failed)} before any data moved ({detail})")
    names = [name for name, _ in sig.fields]
    diffs = _differences(rows, names)
    if diffs:
        # The field values (not just their codes) are exchanged only now, to name them.
        mine = dict(sig.fields)
        texts = _messages(repr([(n, repr(mine.get(n))) for n, _ in diffs]), group, size,
                          timeout_s)
        raise CPMismatchError(_mismatch_text(diffs, texts, names))


def _differences(rows: Sequence[torch.Tensor], names: list[str]) -> list[tuple[str, int]]:
    """(field, index) of every field whose code differs between ranks."""
    if len({int(row[1]) for row in rows}) > 1:
        return [("number of signature fields (different charm_megatron versions?)", -1)]
    base = rows[0]
    out = []
    for i, name in enumerate(names):
        col = 2 + i
        if any(int(row[col]) != int(base[col]) for row in rows[1:]):
            out.append((name, col))
    return out


def _mismatch_text(diffs: list[tuple[str, int]], texts: list[str], names: list[str]) -> str:
    values = []
    for t in texts:
        try:
            values.append(dict(ast.literal_eval(t)))
        except (ValueError, SyntaxError):
            values.append({})
    parts = []
    for name, _ in diffs:
        per_rank = [v.get(name, "?") for v in values]  # each value's repr, as sent
        groups: dict[str, list[int]] = {}
        for r, val in enumerate(per_rank):
            groups.setdefault(val, []).append(r)
        shown = ", ".join(f"{_ranks(rs)}: {val}" for val, rs in groups.items())
        parts.append(f"{name} ({shown})")
    return ("cp_attention: the ranks of the CP group disagree on " + "; ".join(parts)
            + ". Every rank of a CP group must make the same call (same shapes, dtype, algo, "
            "topology, causal, softmax_scale, options) in the same order; nothing was sent")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def exchange_status(code: int, message: str, group: dist.ProcessGroup, size: int,
                    timeout_s: float) -> tuple[list[int], list[str]]:
    """Every rank's status code (``OK``, ``RAISED``, ``BROKEN``) and, when any is not OK, every
    rank's message."""
    got = _all_gather(torch.tensor([code], dtype=torch.int64), group, size, timeout_s,
                      "status")
    codes = [int(x) for x in got]
    if not any(codes):
        return codes, [""] * size
    return codes, _messages(message, group, size, timeout_s)
