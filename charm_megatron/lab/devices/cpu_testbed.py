"""``cpu-testbed``: ``charm-megatron model --calibrate`` on the docs' bench runs
(``docs/performance/*.csv``: the quiet-machine runs of the 2-vCPU emulated cluster; ring rows
only)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile

# The docs' bench runs predate the bench's intra_rate_mbps / cross_burst_kb columns: the rates
# the harness printed before those runs (docs/performance.md, "Method") and the emulator's
# default buckets (charm_megatron.lab.emulate.cluster: 512 KiB cross, 4 MiB intra).
DOCS_BENCH_INTRA_GBPS = 0.1118
DOCS_BENCH_CROSS_BURST_KB = 512.0
DOCS_BENCH_INTRA_BURST_KB = 4096.0
DOCS_BENCH_CORES = 2


def cpu_testbed(paths: Sequence[str], log: Callable[[str], None] | None = None) -> Profile:
    """The testbed's profile calibrated on the bench CSVs ``paths``."""
    from charm_megatron.lab.calibration.calibrate import calibrate

    prof = calibrate(list(paths), name="cpu-testbed", cores=DOCS_BENCH_CORES,
                     intra_gbps=DOCS_BENCH_INTRA_GBPS, cross_burst_kb=DOCS_BENCH_CROSS_BURST_KB,
                     intra_burst_kb=DOCS_BENCH_INTRA_BURST_KB, log=log)
    return replace(prof, topology="2x4", source=prof.source + "; the 2-vCPU emulated cluster "
                   "of CPU-TESTBED.md (--nic node layout; --nic rank: see model.testbed)")


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    return cpu_testbed(inputs.bench, inputs.log)
