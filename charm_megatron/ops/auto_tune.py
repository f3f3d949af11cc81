"""A measured ``auto``: time the model's shortlist once per shape, then run the fastest.

``algo="auto"`` normally runs the performance model's pick (ops/resolution.py). The model can
be wrong where the hardware does something it does not describe: on the CPU testbed it ranks
Ulysses 1.28x ahead of CHARM+ where CHARM+ is measured 1.17x ahead (docs/performance.md,
*Against every CP a user can pick*). With ``CPOptions(auto_tune=margin)``
(``CHARM_AUTO_TUNE``) the first ``auto`` call of each shape:

1. shortlists every algorithm the model predicts within ``margin`` of its fastest
   (:func:`shortlist`; one entry: nothing to measure, the model's pick runs);
2. runs each of them, forward and backward, on detached copies of the call's own inputs
   (:func:`measure`): one warm-up, then the best of ``REPEATS`` timed runs, each a full
   ``cp_attention`` call of that algorithm, so every one is agreed on and fails like any
   call; one that raises is left out on every rank alike;
3. shares every rank's times on the control channel (one exchange, ops/agreement.py
   :func:`~charm_megatron.ops.agreement.share`) and picks the algorithm whose *slowest* rank
   was fastest (:func:`pick`: a step waits for its slowest rank); every rank reads the same
   table, so every rank picks alike;
4. records the pick under the shape's key (:data:`_PICKS`); this and every later call of the
   shape run it, with no further measurement or communication.

The picks a rank holds are part of what the ranks agree on (a digest,
:func:`picks_digest`): a rank that lost them (a restarted process) meets a clear
``CPMismatchError`` instead of running another plan than its peers.

A pick file (``CPOptions(auto_tune_file=...)``, ``CHARM_AUTO_TUNE_FILE``; :func:`save_picks`,
:func:`load_picks`) carries the picks from one run to the next: a different pick is different
bits, so a run is reproduced bitwise only with the picks of the run it reproduces. The first
call with the option reads the file if it exists (:func:`use_file`, before the agreement, so
the digest covers what it read: ranks that read different files disagree by name), and rank 0
writes every pick it holds to it after each measurement. JSON, one pick per shape under its
key's text (:func:`key_text`), with a format version (:data:`FILE_VERSION`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

#: Timed runs per candidate after its warm-up; the best counts (the first call of an
#: algorithm builds its plans and communicators, the warm-up pays for that).
REPEATS = 2
#: The code a rank shares for a candidate that raised (never the fastest).
FAILED = -1

#: The pick file's format version (:func:`save_picks`); a file of another is refused.
FILE_VERSION = 1
_FILE_FORMAT = "charm-megatron auto-tune picks"

_PICKS: dict[str, str] = {}  # key text (key_text) -> algorithm
_DIGEST: list[str | None] = [None]
#: Pick files this process has read at their first use (use_file), by absolute path.
_READ: set[str] = set()
#: The last measurement on this rank (for reports and tests): key, shortlist, every rank's
#: times in seconds (``inf``: failed), the pick.
_LAST: list[Report] = []


@dataclass(frozen=True)
class Pending:
    """A call whose ``auto`` must be measured before it runs."""

    key: tuple
    shortlist: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    """One measurement: the candidates, every rank's seconds per candidate, the pick."""

    key: tuple
    shortlist: tuple[str, ...]
    seconds: tuple[tuple[float, ...], ...]  # [rank][candidate]; inf: it raised there
    pick: str


def shortlist(ranked: Sequence[tuple[float, str]], margin: float) -> tuple[str, ...]:
    """The algorithms of ``ranked`` (predicted seconds, name; fastest first) predicted within
    ``margin`` times the fastest, in that order."""
    best = ranked[0][0]
    return tuple(a for t, a in ranked if t <= best * margin)


def pick(shortlist_: Sequence[str], seconds: Sequence[Sequence[float]]) -> str:
    """The candidate whose slowest rank was fastest (``seconds[rank][candidate]``; ``inf``
    where it raised); ties to the earlier (the model's order). ValueError if every candidate
    failed somewhere."""
    worst = [max(row[i] for row in seconds) for i in range(len(shortlist_))]
    best = min(range(len(shortlist_)), key=lambda i: (worst[i], i))
    if not math.isfinite(worst[best]):
        raise ValueError("every algorithm auto_tune measured failed on some rank")
    return shortlist_[best]


def key_text(key: tuple) -> str:
    """The stable text of a pick's key (``(name, value)`` pairs, ops/resolution.py): the same
    in every process and launch for the same shape, options and package (no addresses, no
    hashes of Python objects). What the picks are held and written under."""
    return "; ".join(f"{name}={_text(value)}" for name, value in key)


def _text(value) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = ", ".join(f"{f.name}={_text(getattr(value, f.name))}"
                          for f in dataclasses.fields(value))
        return f"{type(value).__name__}({inner})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_text(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, str):
        return value
    return repr(value)  # bool, int, float (shortest round trip), None


def lookup(key: tuple) -> str | None:
    """The pick held for ``key`` on this rank, measured or read from a pick file (``None``:
    none yet)."""
    return _PICKS.get(key_text(key))


def picks() -> dict[str, str]:
    """Every pick this rank holds, measured or read: key text (:func:`key_text`) ->
    algorithm, what :func:`save_picks` writes."""
    return dict(sorted(_PICKS.items()))


def picks_digest() -> str | None:
    """A digest of every pick this rank holds, measured or read (``None``: none), for the
    agreement."""
    return _DIGEST[0]


def record(key: tuple, algo: str) -> None:
    _PICKS[key_text(key)] = algo
    _redigest()


def _redigest() -> None:
    text = repr(sorted(_PICKS.items()))
    _DIGEST[0] = hashlib.blake2b(text.encode(), digest_size=8).hexdigest() if _PICKS else None


def forget() -> None:
    """Drop every pick (a new measurement at the next ``auto`` call of each shape; with a pick
    file, the next call reads it again). Every rank of a CP group must call it alike."""
    _PICKS.clear()
    _DIGEST[0] = None
    _LAST.clear()
    _READ.clear()


def save_picks(path: str | os.PathLike) -> int:
    """Write every pick this rank holds to ``path`` (JSON, atomically: a temporary file in the
    same folder, then a rename; the folder is made if missing); the number written. Call it on
    one rank (the option writes from rank 0)."""
    path = os.fspath(path)
    doc = {"format": _FILE_FORMAT, "version": FILE_VERSION,
           "picks": [{"key": k, "algo": a} for k, a in sorted(_PICKS.items())]}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(doc["picks"])


def load_picks(path: str | os.PathLike) -> int:
    """Read the picks of ``path`` (written by :func:`save_picks` or the option) into this rank's
    (a pick of the file replaces one held for the same key); the number read. Every rank of a
    CP group must load alike: the picks held are agreed on (a digest). ValueError naming the
    file and the fix if it is missing, unreadable or of another format version."""
    from charm_megatron.plan import registry

    path = os.fspath(path)
    fix = ("delete it (the next run with auto_tune measures and writes it again) or give "
           "another file (auto_tune_file / CHARM_AUTO_TUNE_FILE)")

    def bad(why: str) -> ValueError:
        return ValueError(f"auto_tune: the pick file {path!r} {why}; {fix}")

    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        raise bad("does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != _FILE_FORMAT:
        raise bad(f"is not a pick file (no \"format\": \"{_FILE_FORMAT}\")")
    if doc.get("version") != FILE_VERSION:
        raise bad(f"is of format version {doc.get('version')!r}, this package reads version "
                  f"{FILE_VERSION}")
    picks = doc.get("picks")
    if not isinstance(picks, list) or not all(
            isinstance(p, dict) and isinstance(p.get("key"), str)
            and isinstance(p.get("algo"), str) for p in picks):
        raise bad('has no list of {"key": text, "algo": name} under "picks"')
    unknown = sorted({p["algo"] for p in picks} - set(registry.names()))
    if unknown:
        raise bad(f"picks unregistered algorithm(s) {', '.join(unknown)} (registered: "
                  f"{', '.join(registry.names())})")
    for p in picks:
        _PICKS[p["key"]] = p["algo"]
    _redigest()
    return len(picks)


def use_file(path: str) -> None:
    """``auto_tune_file``'s first use in this process: read ``path`` if it exists (once; a file
    that does not exist yet is written by this run's measurements). Called while a call's
    request is built, before the agreement, so a rank that read another file than its peers
    is named (``auto-tune picks held``)."""
    where = os.path.abspath(path)
    if where in _READ:
        return
    if os.path.exists(where):
        load_picks(path)
    _READ.add(where)


def write_file(path: str | None) -> None:
    """After a measurement: rank 0 writes every pick it holds to ``path`` (``None``: no file).
    A failed write warns and the run goes on (the picks are held; the ranks have agreed)."""
    import torch.distributed as dist

    if path is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _READ.add(os.path.abspath(path))  # this run's own picks; never read back in this process
    try:
        save_picks(path)
    except OSError as exc:
        warnings.warn(f"auto_tune: could not write the pick file {path!r} ({exc}); the picks "
                      "are held in this process but will not be reproduced by a later run",
                      RuntimeWarning, stacklevel=2)


def last_report() -> Report | None:
    """This rank's most recent measurement (``None``: none yet)."""
    return _LAST[-1] if _LAST else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run: Callable[..., torch.Tensor], algo: str, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, offset: torch.Tensor | None) -> float:
    """Seconds of ``algo``'s forward + backward on copies of the inputs: the best of
    :data:`REPEATS` after one warm-up. ``run(algo, q, k, v, offset)`` is the call."""
    gen = torch.Generator(device=q.device).manual_seed(0)  # the caller's RNG stays untouched
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    off = None if offset is None else offset.detach().clone().requires_grad_(offset.requires_grad)
    dout = None
    best = math.inf
    with torch.enable_grad():
        for i in range(1 + REPEATS):
            _sync(q.device)
            start = time.perf_counter()
            out = run(algo, *leaves, off)
            if dout is None:
                dout = torch.randn(out.shape, generator=gen, device=out.device,
                                   dtype=out.dtype)
            torch.autograd.backward(out, dout)
            _sync(q.device)
            if i:
                best = min(best, time.perf_counter() - start)
            for t in (*leaves, off):
                if t is not None:
                    t.grad = None
    return best


def tune(pending: Pending, run: Callable[..., torch.Tensor],
         inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], sg,
         options) -> str:
    """Measure ``pending``'s shortlist on this rank with ``inputs`` (q, k, v, the softmax
    offset or ``None``), share the times with the CP group's ranks (``sg``, within
    ``options.timeout_s``), record and return the pick (the same on every rank); rank 0
    writes the picks held to ``options.auto_tune_file`` (``None``: none)."""
    from charm_megatron.ops.agreement import share

    q, k, v, offset = inputs
    timeout_s, path = options.timeout_s, options.auto_tune_file

    mine, errors = [], []
    for algo in pending.shortlist:
        try:
            mine.append(measure(run, algo, q, k, v, offset))
        except Exception as exc:  # noqa: BLE001 - a failed candidate is left out, everywhere
            mine.append(math.inf)
            errors.append(f"{algo}: {type(exc).__name__}: {exc}")
    codes = [FAILED if not math.isfinite(s) else max(0, round(s * 1e9)) for s in mine]
    table = share(sg, codes, timeout_s, "auto-tune")
    seconds = tuple(tuple(math.inf if c == FAILED else c / 1e9 for c in row) for row in table)
    try:
        chosen = pick(pending.shortlist, seconds)
    except ValueError:
        from charm_megatron.ops.agreement import CPAttentionError

        raise CPAttentionError(
            f"cp_attention(algo='auto', auto_tune): every algorithm of the shortlist "
            f"{', '.join(pending.shortlist)} failed on some rank while being measured (here: "
            f"{'; '.join(errors) or 'none failed'}); run them by name to see each rank's "
            "error, or set auto_tune off (CHARM_AUTO_TUNE=off)") from None
    record(pending.key, chosen)
    write_file(path)
    _LAST.append(Report(pending.key, pending.shortlist, seconds, chosen))
    del _LAST[:-1]
    return chosen
