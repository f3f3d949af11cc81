"""Dynamic CP: one ``CharmDotProductAttention`` layer on successive micro-batches with different
CP groups from ``packed_seq_params`` (``cp_group`` / ``local_cp_size``, as megatron-core's
hybrid CP sets them), each checked against a float64 full-sequence reference: out, dq, dk, dv.

4 gloo ranks; the module's own CP group is all 4. Micro-batches: pairs [0,1] / [2,3], then pairs
[0,2] / [1,3] (another group of the same size), then the module's group (no
``packed_seq_params``), then CP off (``local_cp_size=1``, no group). Then: a fixed topology
(``2x2``) refused for a 2-rank dynamic group, on every rank, before any communication.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from charm_megatron.local_ranks import run_ranks
from dist_cases import local_part, make_inputs, reference, rel_err

pytest.importorskip("megatron.core")

from test_megatron_model import _config, _cpu_megatron, _init_parallel  # noqa: E402

S, B, HQ, HKV, D = 32, 2, 4, 2, 16
TOL = 1e-5  # fp32 against float64, relative norm


def _micro_batch(attn, group, seed: int, packed) -> dict[str, float]:
    """One forward/backward of ``attn`` on this rank's load-balanced part of a sequence split
    over ``group`` (``None``: no CP); relative errors vs float64."""
    rank, size = (0, 1) if group is None else (group.rank(), group.size())
    q, k, v, dout = make_inputs(seed, S, B, HQ, HKV, D)
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, True, attn.softmax_scale)
    part = [local_part(x, rank, size, True).float().requires_grad_(True) for x in (q, k, v)]
    out = attn(*part, None, packed_seq_params=packed)  # [s/cp, b, h*d]
    out = out.reshape(out.shape[0], B, HQ, D)
    out.backward(local_part(dout, rank, size, True).float())
    refs = (ref_out, ref_dq, ref_dk, ref_dv)
    got = (out, *(t.grad for t in part))
    return {name: rel_err(x, local_part(r, rank, size, True))
            for name, x, r in zip(("out", "dq", "dk", "dv"), got, refs)}


def _rank_dynamic(rank: int, world: int) -> dict:
    _cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from charm_megatron.megatron import CharmDotProductAttention

    _init_parallel(1, 4)
    # Every rank creates every group, in the same order.
    pairs_a = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pairs_b = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine_a, mine_b = pairs_a[rank // 2], pairs_b[rank % 2]

    def layer(topology):
        return CharmDotProductAttention(
            config=_config(1, 4, HKV), layer_number=1, attn_mask_type=AttnMaskType.causal,
            attention_type="self", cp_comm_type="charm", topology=topology,
        )

    attn = layer("auto")  # size-free: probed per group
    out: dict = {}
    out["pair_a"] = _micro_batch(
        attn, mine_a, 10 + rank // 2,
        PackedSeqParams(qkv_format="sbhd", cp_group=mine_a, local_cp_size=2))
    out["pair_b"] = _micro_batch(
        attn, mine_b, 20 + rank % 2, PackedSeqParams(qkv_format="sbhd", cp_group=mine_b))
    out["module_group"] = _micro_batch(attn, ps.get_context_parallel_group(), 30, None)
    out["cp_off"] = _micro_batch(attn, None, 40 + rank, PackedSeqParams(local_cp_size=1))
    out["cached"] = sorted(attn._topologies)

    fixed = layer("2x2")
    try:
        _micro_batch(fixed, mine_a, 50, PackedSeqParams(cp_group=mine_a))
        out["fixed"] = "ok"
    except ValueError as exc:
        out["fixed"] = str(exc)
    try:
        attn(*(torch.zeros(S // 2, B, h, D) for h in (HQ, HKV, HKV)), None,
             packed_seq_params=PackedSeqParams(cp_group=mine_a, local_cp_size=4))
        out["size_mismatch"] = "ok"
    except ValueError as exc:
        out["size_mismatch"] = str(exc)
    ps.destroy_model_parallel()
    return out


def test_one_layer_two_dynamic_groups_then_module_group_then_no_cp():
    results = run_ranks(_rank_dynamic, 4, timeout_s=240)
    for rank, res in enumerate(results):
        for mb in ("pair_a", "pair_b", "module_group", "cp_off"):
            for name, err in res[mb].items():
                assert err <= TOL, (rank, mb, name, err)
        # One topology per CP group the layer ran on (CP off needs none).
        assert res["cached"] == sorted(
            [tuple(sorted((2 * (rank // 2), 2 * (rank // 2) + 1))), (rank % 2, rank % 2 + 2),
             (0, 1, 2, 3)]
        ), res["cached"]
        assert "dynamic CP group" in res["fixed"] and "2x2" in res["fixed"], res["fixed"]
        assert "size-free topology" in res["fixed"]
        assert "local_cp_size=4 but its cp_group has 2 ranks" in res["size_mismatch"]
