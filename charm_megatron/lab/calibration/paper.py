"""Published numbers the GPU profiles stand on, each with its source, and the paper's H100 table.

Nothing here is fitted; :mod:`charm_megatron.lab.calibration.refit` fits the profiles from these.

* :data:`TABLE2` - the CHARM+ paper's Table 2 (NCCL / RDMA unidirectional point-to-point
  tests, GB/s) and the bf16 dense peak it lists;
* :data:`TABLE5` - the paper's Table 5 (H100, 12 heads x 192, bf16; ring and CHARM+ forward and
  backward, ms). The GPU profiles are fitted on its *ring* columns only;
* :data:`TABLE4` - the paper's Table 4 (its ablation: ring, RM+ and CHARM+ forward on L20 and
  H20 at two sequence lengths, ms; batch and heads not stated, so :mod:`.refit` fits one shape
  from the paper's grid on the *ring* column, with the ``h20-table4`` profile);
* :data:`FA2_H100_FWD` - FlashAttention-2's forward rate on one H100 SXM5 against sequence
  length and head dim, as printed on the bars of the FlashAttention-3 paper's forward-speed
  figures (Shah et al., 2024, arXiv:2407.08608; bf16, non-causal, batch x seqlen = 16k,
  heads x head dim = 2048). The kernel-rate-against-tile-size curve of the GPU profiles;
* :data:`FA2_FWD_BWD_UTILISATION` - FlashAttention-2's forward and backward utilisation on A100
  (Dao, 2023, arXiv:2307.08691: up to 73 % of peak forward, 63 % backward): the backward
  factor ``2.5 * 73 / 63`` (2.5: backward has 2.5x the forward's FLOPs);
* :data:`HOPPER_KERNELS` - FlashAttention-2, cuDNN and FlashAttention-3 on one H100 SXM5 at
  16k tokens, TFLOP/s by head dim: forward (causal) and backward (non-causal, the only
  backward bars), as printed on the FA-3 paper's bar charts (same setup as above); the
  ``assumed`` curves of the kernels we have not measured are our measured FA-2 curve times
  these ratios (:mod:`charm_megatron.lab.devices.hopper_kernels`);
* :data:`OVERLAP_COMPUTE_SLOWDOWN` - compute kernels run 18.9 % slower on average (40 % at
  worst) while communication runs on the same GPU (Lee et al., 2025, "Characterizing
  Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning",
  arXiv:2507.03114; A100 / H100 / MI250 / MI210). The GPU profiles charge it once per
  communicator moving data (``Cluster.comm_slowdown_streams`` left uncapped; docs/model.md,
  "Effects": the H200 proxy's 0.8 % per thread block puts it at about 24 blocks, one
  communicator's kernel).
* :data:`MEMORY_GBPS` - each GPU's memory bandwidth (NVIDIA's datasheets) and
  :data:`MERGE_TRAFFIC_PER_PARTIAL_BYTE`: :func:`merge_bound_gbps`, the fastest a merge of
  partials into fp32 accumulators can run on it (no profile's ``merge_gbps`` may exceed it).
"""

from __future__ import annotations

from dataclasses import dataclass

# GPU: (bf16 dense peak TFLOP/s, cross GB/s, intra GB/s), Table 2.
TABLE2: dict[str, tuple[float, float, float]] = {
    "L20": (119.5, 14.7, 24.0),
    "H20": (148.0, 42.6, 297.2),
    "H100": (989.0, 42.5, 365.1),
}

# Sequence length -> TFLOP/s, per head dim (FlashAttention-2 bars of FA-3's Fig. "Attention
# forward speed, head dim 128 / 256 (H100 80GB SXM5)").
FA2_H100_FWD: dict[int, dict[int, float]] = {
    128: {512: 309.0, 1024: 350.0, 2048: 362.0, 4096: 368.0, 8192: 370.0, 16384: 370.0},
    256: {512: 208.0, 1024: 251.0, 2048: 278.0, 4096: 293.0, 8192: 297.0, 16384: 298.0},
}

FA2_FWD_BWD_UTILISATION = (0.73, 0.63)

# kernel -> pass -> head dim -> TFLOP/s at 16k tokens (FA-3 paper's H100 SXM5 BF16 charts:
# forward causal; backward non-causal, no head dim 256 bars). The FA-2 entries are the ratios'
# denominators.
HOPPER_KERNELS: dict[str, dict[str, dict[int, float]]] = {
    "fa2": {"fwd": {64: 299.0, 128: 335.0, 256: 298.0}, "bwd": {64: 291.0, 128: 322.0}},
    "cudnn": {"fwd": {64: 388.0, 128: 539.0, 256: 509.0}, "bwd": {64: 433.0, 128: 516.0}},
    "fa3": {"fwd": {64: 473.0, 128: 616.0, 256: 642.0}, "bwd": {64: 474.0, 128: 561.0}},
}
OVERLAP_COMPUTE_SLOWDOWN = 0.189

# GPU -> memory bandwidth, GB/s (NVIDIA datasheets: H100 SXM5 80 GB HBM3 3.35 TB/s; H200 SXM
# 141 GB HBM3e 4.8 TB/s; H20 96 GB HBM3 4.0 TB/s; L20 48 GB GDDR6 864 GB/s).
MEMORY_GBPS: dict[str, float] = {"H100": 3350.0, "H200": 4800.0, "H20": 4000.0, "L20": 864.0}

# A merge folds a 16-bit partial into an fp32 accumulator: per element it reads the accumulator
# (4 B) and the partial (2 B) and writes the accumulator (4 B), 10 B of memory traffic per 2 B of
# partial. The model's ``merge_gbps`` counts bytes of partial (Problem.local_bytes: the partial
# in the input dtype, and for an output its fp32 lse, as scripts/gpu_check.py times it). An
# output's lse (fp32, read 4 B + 4 B, written 4 B per 4 B) moves less per byte, so 5 is the most
# any merge moves per byte of partial (dq / dk / dv: exactly 5; an output at head dim d:
# (10 d + 16) / (2 d + 4)): at or below memory bandwidth / 5 every merge can run.
MERGE_TRAFFIC_PER_PARTIAL_BYTE = 5.0


def merge_bound_gbps(gpu: str) -> float:
    """The fastest merge ``gpu``'s memory allows, GB/s of partial (:data:`MEMORY_GBPS` /
    :data:`MERGE_TRAFFIC_PER_PARTIAL_BYTE`; H100: 670)."""
    return MEMORY_GBPS[gpu] / MERGE_TRAFFIC_PER_PARTIAL_BYTE


def bandwidth_scaled(gbps: float, measured_on: str, gpu: str) -> float:
    """A memory-bound rate measured on ``measured_on`` as it runs on ``gpu`` (times the ratio of
    their :data:`MEMORY_GBPS`): the same kernel reaching the same fraction of bandwidth."""
    return gbps * MEMORY_GBPS[gpu] / MEMORY_GBPS[measured_on]


@dataclass(frozen=True)
class Table5Row:
    """One row of Table 5: ``gpus`` x 8 H100, batch ``b``, sequence ``s``; ms."""

    topology: str
    b: int
    s: int
    ring_fwd: float
    charm_fwd: float
    ring_bwd: float
    charm_bwd: float


# Problem of every row: 12 heads of 192, bf16 (Appendix C.2). The mask is not stated; ring and
# TASP are run without zigzag, so the rows are taken as full (non-causal) attention.
TABLE5_HEADS, TABLE5_HEAD_DIM, TABLE5_ELEM, TABLE5_CAUSAL = 12, 192, 2, False
# The paper's implementation sends partials (dk / dv, partial outputs) in fp32: its ring
# backward takes 3.0x its forward at every row (a link-bound ring moving kv and dkv in bf16
# takes 2.0x; kv in bf16 and dkv in fp32, 3.0x), as ring-flash-attention's ring does. Read off
# the ring columns, never a CHARM+ one; the rows are predicted with CPOptions(partials="fp32").
TABLE5_WIDE_PARTIALS = True
TABLE5: tuple[Table5Row, ...] = (
    Table5Row("2x8", 16, 26880, 149.97, 63.93, 449.58, 141.52),
    Table5Row("2x8", 16, 13440, 72.65, 31.84, 226.46, 65.35),
    Table5Row("2x8", 64, 6720, 141.75, 61.80, 448.84, 123.32),
    Table5Row("2x8", 128, 3360, 140.55, 61.54, 450.01, 121.99),
    Table5Row("4x8", 16, 31744, 185.42, 68.17, 559.34, 146.01),
    Table5Row("4x8", 16, 15872, 89.27, 34.64, 279.85, 70.62),
    Table5Row("4x8", 64, 7936, 179.13, 66.48, 556.25, 134.48),
    Table5Row("4x8", 128, 3968, 178.51, 66.43, 560.63, 133.05),
)


@dataclass(frozen=True)
class Table4Row:
    """One row of Table 4: ``gpu`` (``"L20"`` / ``"H20"``) on ``topology`` (``1xN``: one NUMA
    domain or node, no slow link; ``2xN``: across NUMA domains or nodes), sequence ``s``;
    forward ms. ``charm`` is ``None`` where the paper runs no CHARM+ (no slow link)."""

    gpu: str
    topology: str
    s: int
    ring: float
    rmplus: float
    charm: float | None


# Table 4 states only the sequence length. The paper's grid (Section 4.1): 12 or 20 heads of 128
# or 192, B x S <= 500K; forward only; bf16 and full attention taken as for Table 5.
TABLE4_HEADS, TABLE4_HEAD_DIMS, TABLE4_MAX_TOKENS = (12, 20), (128, 192), 500_000
TABLE4_ELEM, TABLE4_CAUSAL = 2, False
TABLE4: tuple[Table4Row, ...] = (
    Table4Row("L20", "1x4", 1792, 9.35, 10.29, None),
    Table4Row("L20", "1x4", 7168, 36.86, 39.66, None),
    Table4Row("L20", "2x4", 1792, 17.61, 25.91, 14.81),
    Table4Row("L20", "2x4", 7168, 69.85, 98.49, 52.40),
    Table4Row("H20", "1x4", 1792, 5.38, 4.76, None),
    Table4Row("H20", "1x4", 7168, 38.62, 33.20, None),
    Table4Row("H20", "1x8", 1792, 5.51, 3.65, None),
    Table4Row("H20", "1x8", 7168, 26.79, 13.84, None),
    Table4Row("H20", "2x8", 1792, 32.17, 39.04, 12.16),
    Table4Row("H20", "2x8", 7168, 84.58, 98.98, 28.91),
)
