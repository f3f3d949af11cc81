"""The fused (Triton) merge against the float64 merge, run by Triton's interpreter on CPU.

The kernel is CUDA's; ``TRITON_INTERPRET=1`` runs the same kernel source on CPU tensors, so
its arithmetic, masking and strides are checked here (the GPU run: docs/gpu-check.md). The
interpreter has to be chosen before Triton is imported, hence a child process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from charm_megatron.kernels import merge_fused

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import torch
    from charm_megatron.kernels import merge_fused
    from charm_megatron.kernels.merge import merge_into_unfused

    g = torch.Generator().manual_seed(7)
    worst = 0.0
    for r, b, h, d, dt in ((7, 2, 3, 40, torch.bfloat16), (33, 1, 4, 64, torch.float32),
                           (5, 3, 2, 128, torch.float16), (9, 2, 1, 192, torch.bfloat16)):
        acc = torch.randn(r, b, h, d, generator=g)
        acc_lse = torch.randn(r, b, h, generator=g) * 3
        acc[0], acc_lse[0] = 0.0, float("-inf")          # row 0: no key seen yet
        part = torch.randn(b, h, r, d, generator=g).to(dt).permute(2, 0, 1, 3)  # kernel-shaped
        plse = torch.randn(b, h, r, generator=g) * 3
        plse[:, :, 0:2] = float("-inf")                  # rows 0-1: none in this partial
        plse = plse.permute(2, 0, 1)
        ref_o, ref_l = acc.double(), acc_lse.double()
        merge_into_unfused(ref_o, ref_l, part.double(), plse.double())
        merge_fused.merge_into(acc, acc_lse, part, plse)
        assert not acc.isnan().any() and not acc_lse.isnan().any()
        assert torch.equal(acc_lse.isneginf(), ref_l.isneginf())
        assert (acc[0] == 0).all()
        fin = ref_l.isfinite()
        err_o = float((acc.double() - ref_o).abs().max() / ref_o.abs().max())
        err_l = float((acc_lse.double() - ref_l)[fin].abs().max())
        worst = max(worst, err_o, err_l)
    print("WORST", worst)
""")


def test_fused_merge_matches_float64_in_the_interpreter() -> None:
    pytest.importorskip("triton")  # a dev dependency: CI has it
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    worst = float(proc.stdout.split("WORST")[-1])
    assert worst < 1e-5, worst  # fp32 arithmetic against float64


def test_fused_merge_is_never_taken_for_cpu_or_non_fp32_accumulators() -> None:
    acc = torch.zeros(4, 1, 2, 8)
    lse = torch.zeros(4, 1, 2)
    assert not merge_fused.usable(acc, lse, acc)  # CPU: the PyTorch ops
    assert not merge_fused.usable(acc.double(), lse.double(), acc)


def test_fused_merge_refuses_a_partial_of_another_shape() -> None:
    with pytest.raises(ValueError, match="do not match the accumulator"):
        merge_fused.merge_into(torch.zeros(4, 1, 2, 8), torch.zeros(4, 1, 2),
                               torch.zeros(3, 1, 2, 8), torch.zeros(3, 1, 2))
