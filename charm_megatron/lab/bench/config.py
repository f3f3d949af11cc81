"""What the benchmark measures: the grid of problem sizes and the run settings (no torch)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from charm_megatron.lab.bench.gpu_emulation import DeviceSetup
from charm_megatron.model.te_contenders import TE_NAMES
from charm_megatron.plan.registry import NameView, names
from charm_megatron.plan.vocab import Dtype

#: The contenders: the registered algorithms, and ``torch`` (PyTorch's own CP ring).
ALGOS = NameView(lambda: (*names(), "torch"))
#: What ``--algos`` accepts: the contenders, ``auto`` (cp_attention's own pick, timed and
#: reported beside the others; not in the default line-up) and TransformerEngine's CP types as
#: shipped (``te-p2p``, ...: :mod:`charm_megatron.model.te_contenders`; not in the default
#: line-up either).
ALGO_CHOICES = NameView(lambda: (*names(), "auto", "torch", *TE_NAMES))
PASSES = ("fwd", "bwd", "fwdbwd")
DTYPES = ("fp32", "bf16", "fp16")

# The paper's grid (Section 4.1): hidden sizes 12 or 20 heads of 128 or 192; S from 1K to 100K
# with B*S <= 500K. The CPU preset scales it down so a grid runs in minutes on 2 cores.
PRESETS: dict[str, dict] = {
    "paper": {"batch": "1,2,4", "seq": "16k,32k,64k,128k", "heads": "12x128,20x128,12x192,20x192",
              "dtype": "bf16", "warmup": 5, "iters": 20, "max_tokens": 500_000},
    "cpu-small": {"batch": "1", "seq": "2k,4k,8k", "heads": "4x64,8x64", "dtype": "bf16",
                  "warmup": 2, "iters": 5, "max_tokens": 0},
    "tiny": {"batch": "1", "seq": "256", "heads": "2x32", "dtype": "fp32", "warmup": 1,
             "iters": 2, "max_tokens": 0},
}


@dataclass(frozen=True)
class HeadSpec:
    """``heads x dim`` as in the paper's ``12x128`` (12 query heads of dimension 128)."""

    heads: int
    dim: int

    @classmethod
    def parse(cls, text: str) -> HeadSpec:
        m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"cannot read heads {text!r}: write HEADSxDIM, e.g. 12x128")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.heads}x{self.dim}"


def parse_count(text: str) -> int:
    """``"8k"`` -> 8192, ``"1m"`` -> 1048576, ``"3000"`` -> 3000."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"cannot read {text!r}: use an integer, optionally with k or m (2k = 2048)")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]


def parse_list(text: str, item) -> list:
    """Comma-separated values, each read by ``item``."""
    values = [item(x) for x in str(text).split(",") if x.strip()]
    if not values:
        raise ValueError(f"empty list {text!r}")
    return values


def parse_grid_shape(text: str) -> tuple[int, int]:
    """``"2x4"`` -> (2, 4): G emulated nodes of M ranks."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"cannot read {text!r}: write GxM, e.g. 2x4 (2 nodes of 4 ranks)")
    return int(m.group(1)), int(m.group(2))


@dataclass(frozen=True)
class Point:
    """One problem size of the grid: global sequence ``seq`` over the whole CP group."""

    index: int
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def label(self) -> str:
        gqa = f"/{self.kv_heads}" if self.kv_heads != self.heads else ""
        return f"B={self.batch} S={self.seq} H={self.heads}{gqa}x{self.head_dim}"


@dataclass
class BenchConfig:
    """Everything a rank needs to run the benchmark (picklable, no torch objects)."""

    batches: list[int]
    seqs: list[int]
    heads: list[HeadSpec]
    kv_heads: int | None = None  # None: as many as query heads (no GQA)
    dtype: str = "bf16"
    causal: bool = True
    algos: list[str] = field(default_factory=lambda: list(ALGOS))
    topology: str | None = None  # CHARM+ topology; None: resolved by the launcher
    warmup: int = 2
    iters: int = 5
    backward: bool = True
    ccr: bool = True  # ring's compute-only and comm-only runs (for the CCR)
    bound: bool = True  # compute-only runs of every plan algorithm (for the lower bound)
    memory: bool = True
    max_tokens: int = 0  # skip points with batch*seq above this (0: no limit)
    threads: int = 1  # intra-op threads per CPU rank
    torch_rotate: str = "alltoall"
    seed: int = 0
    packed_mean: int = 0  # > 0: packed documents (THD) of this mean length (lab/bench/packing.py)
    roles: str = "bytes"  # role mix of rmplus / charm (charm_megatron.plan.roles.ROLE_MIXES)
    partials: str = "input"  # the wire dtype of partial results (CPOptions.partials)
    # The auto contender's CPOptions.auto_tune (--auto-tune): None, the model's pick.
    auto_tune: str | None = None
    # Algorithm settings by name (--setting NAME=VALUE), over the job's CHARM_* variables.
    settings: tuple[tuple[str, str], ...] = ()
    # An emulated GPU cluster (--device-model): every rank's device is timed, not computed,
    # and every *_ms is device time (lab/bench/gpu_emulation.py, docs/emulator.md).
    device: DeviceSetup | None = None
    # A sliding window (--window LEFT[,RIGHT]) of every call, in the point's (virtual) rows.
    window: tuple[int, int] | None = None

    def wire_window(self) -> tuple[int, int] | None:
        """The window as the calls run it: on an emulated cluster whose wire copy divides the
        rows by ``R``, the window spans ``1/R`` as many rows (so every ratio of window to
        chunk stays the point's; the model and the device see the virtual window)."""
        if self.window is None or self.device is None or self.device.rows_scale == 1:
            return self.window
        r = self.device.rows_scale
        bad = [w for w in self.window if w > 0 and w % r]
        if bad:
            raise ValueError(f"--window {self.window[0]},{self.window[1]}: the wire copy "
                             f"divides rows by {r} (--wire-scale), which does not divide "
                             f"{bad[0]}; give a window that is a multiple of {r}, or a "
                             "--wire-scale whose rows factor divides it")
        return tuple(w // r if w > 0 else w for w in self.window)

    @property
    def wide_partials(self) -> bool:
        """Partials travel in fp32 (``--partials fp32``): what the model's problems carry."""
        return Dtype(self.partials) is Dtype.FP32

    def problem_window(self) -> tuple[int, int] | None:
        """The window a :class:`~charm_megatron.plan.cost.Problem` of a point carries (none
        for packed points: their plans keep every tile, as the model then prices them)."""
        return None if self.window in (None, (-1, -1)) or self.packed_mean else self.window

    def points(self, world: int) -> tuple[list[Point], list[str]]:
        """The grid for a CP group of ``world`` ranks, and a line per point left out (why)."""
        points: list[Point] = []
        dropped: list[str] = []
        div = 2 * world if self.causal else world
        if self.packed_mean:
            div = 2 * world  # THD: every document in 2*cp chunks, causal or not
        for b, s, h in itertools.product(self.batches, self.seqs, self.heads):
            kv = self.kv_heads or h.heads
            label = f"B={b} S={s} H={h}"
            if h.heads % kv:
                dropped.append(f"{label}: {h.heads} query heads are not a multiple of "
                               f"--kv-heads {kv}")
                continue
            if self.packed_mean and (b * s) % div:
                dropped.append(f"{label}: B*S={b * s} is not divisible by 2 x {world} ranks "
                               "(packed)")
                continue
            if not self.packed_mean and s % div:
                dropped.append(f"{label}: S={s} is not divisible by {div} "
                               f"({'2 x ' if self.causal else ''}{world} ranks)")
                continue
            if self.max_tokens and b * s > self.max_tokens:
                dropped.append(f"{label}: B*S={b * s} exceeds --max-tokens {self.max_tokens}")
                continue
            points.append(Point(len(points), b, s, h.heads, kv, h.dim))
        return points, dropped

    def variants(self) -> list[tuple[str, str]]:
        """(algorithm, mode) pairs timed in every iteration; mode ``full`` is the real run,
        ``compute``/``comm`` are ablated runs (communication or computation switched off)."""
        out = [(a, "full") for a in self.algos]
        plan_algos = [a for a in self.algos if a != "torch"]
        if self.ccr and "ring" in self.algos:
            out += [("ring", "compute"), ("ring", "comm")]
        if self.bound:
            out += [(a, "compute") for a in plan_algos if (a, "compute") not in out]
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["heads"] = [str(h) for h in self.heads]
        return d


def element_size(dtype: str) -> int:
    return {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]


def check_algos(algos: Sequence[str]) -> list[str]:
    bad = [a for a in algos if a not in ALGO_CHOICES]
    if bad:
        raise ValueError(f"unknown algorithm(s) {', '.join(bad)}; choose from "
                         f"{', '.join(ALGO_CHOICES)}")
    return list(dict.fromkeys(algos))


def parse_settings(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``--setting NAME=VALUE`` items, each checked against the registered settings (a
    ``SystemExit`` naming the bad item and the choices)."""
    from charm_megatron.plan.registry import all_settings

    known = all_settings()
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in known:
            raise SystemExit(f"charm-megatron bench: --setting {item!r}: expected NAME=VALUE "
                             f"with NAME one of {', '.join(known)}")
        try:
            known[name].parse(value, "--setting")
        except ValueError as exc:
            raise SystemExit(f"charm-megatron bench: {exc}") from None
        out[name] = value
    return tuple(sorted(out.items()))
