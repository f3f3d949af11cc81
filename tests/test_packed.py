"""Packed sequences (THD) on real gloo ranks against a float64 per-document reference.

One process group per world size runs the whole matrix (algorithms, topologies, masks, dtypes,
GQA ratios, document mixes); starting processes dominates the cost of these small problems.
"""

import itertools
import re

import pytest
import torch
from dist_failure_cases import check_clean_failure

import packed_cases
from charm_megatron.layout import thd_index, thd_pad, thd_shard, thd_unpad, thd_unshard
from charm_megatron.local_ranks import run_ranks
from charm_megatron.ops.packed import THDLayout, lane_order, make_layout, tile_segments
from charm_megatron.plan.core import Half, tile_spec
from charm_megatron.plan.head_stage import HeadStage

TOL = {"fp32": 1e-5, "bf16": 2e-2}
DOCS = ("one", "short", "unequal", "nopad")

SETUPS = {
    1: [("ring", None), ("charm", None)],
    2: [("ring", None), ("rmplus", None), ("charm", "flat")],
    3: [("ring", None), ("rmplus", None), ("charm", "flat"), ("allgather", None)],
    4: [("ring", None), ("rmplus", None), ("charm", "2x2"), ("charm", "flat"), ("auto", "2x2")],
    8: [("ring", None), ("rmplus", None), ("charm", "2x4"), ("charm", "4x2"), ("allgather", None)],
}


# Grouped-query attention under both role mixes (8 query heads, 2 or 1 kv heads, where the byte
# rule passes kv where the paper passes q: test_byte_rule_changes_the_gqa_plans), causal and
# full, forward and backward. CHARM+ 2x2 meets every role mix, rmplus and a G=4 CHARM+ one
# each; the whole group shares the matrix's processes.
GQA_ROLES = {
    4: [("charm", "2x2", roles, hkv, causal) for roles in ("bytes", "paper") for hkv in (2, 1)
        for causal in (True, False)]
       + [("rmplus", None, "bytes", 2, True), ("rmplus", None, "paper", 1, False)],
    8: [("charm", "4x2", "bytes", 1, True), ("charm", "2x4", "bytes", 2, False)],
}


# The head all-to-alls (a2a, a2a+p2p): (algo, topology, kv heads, q heads) with heads that
# divide by their all-to-all group, every mask and document mix, both dtypes.
HEAD_A2A = {
    2: [("a2a", None, 2, 4), ("a2a", None, 2, 2)],
    4: [("a2a", None, 4, 8), ("a2a+p2p", "2x2", 2, 4)],
    8: [("a2a+p2p", "2x4", 4, 8), ("a2a+p2p", "4x2", 2, 4)],
}


def _cases(world):
    """Every (algo, topology) x mask x document mix; dtype and GQA ratio rotate so that each
    document mix meets both dtypes and several ratios. CP size 1 also takes odd lengths. Then
    the GQA role-mix cases (8 query heads, the ``unequal`` documents, fp32) and the head
    all-to-alls."""
    cases = []
    docs_here = DOCS + (("odd",) if world == 1 else ())
    for algo, topo in SETUPS[world]:
        for i, (causal, docs) in enumerate(itertools.product((True, False), docs_here)):
            dtype = ("fp32", "bf16")[(i + i // 4) % 2]
            hkv = (4, 2, 1)[(i + len(cases)) % 3]
            cases.append((algo, topo, causal, dtype, hkv, docs))
    for algo, topo, roles, hkv, causal in GQA_ROLES.get(world, []):
        cases.append((algo, topo, causal, "fp32", hkv, "unequal", roles, 8))
    for algo, topo, hkv, hq in HEAD_A2A.get(world, []):
        for i, (causal, docs) in enumerate(itertools.product((True, False), DOCS)):
            cases.append((algo, topo, causal, ("fp32", "bf16")[i % 2], hkv, docs, None, hq))
    return cases


def test_lane_order_gives_each_lane_the_thd_layout_of_its_super_blocks():
    # After the head all-to-all a super-block holds its members' internal rows member by
    # member (HeadStage.pieces); lane_order must turn them into Megatron's THD layout of n/a
    # ranks (thd_index, in that layout's internal order), every document and padding row.
    for n, a, causal in ((4, 2, True), (4, 4, True), (8, 2, False), (6, 3, True), (4, 4, False)):
        padded = (2 * n * 3, 2 * n, 2 * n * 5)
        flat = THDLayout(n, tuple(p - 1 for p in padded), padded)
        cu = torch.tensor([0, *itertools.accumulate(padded)])
        stage = HeadStage(n, a, causal)
        internal = torch.tensor(flat.permutation())
        lanes = flat.lanes(a)
        for r in range(n):
            placed = torch.empty(a * flat.t_local, dtype=torch.long)
            for j, member in enumerate(stage.members(r)):
                ids = thd_index(member, n, cu)[internal]  # global ids in internal order
                for local, sup in stage.pieces(j, flat.t_local):
                    placed[sup] = ids[local]
            want = thd_index(r // a, n // a, cu)[torch.tensor(lanes.permutation())]
            got = placed[torch.tensor(lane_order(flat, stage, r))]
            assert got.tolist() == want.tolist(), (n, a, causal, r)


@pytest.mark.parametrize("world", sorted(SETUPS))
def test_packed_matrix_against_float64_reference(world):
    cases = _cases(world)
    repeat = [c for c in cases if c[3] == "fp32" and c[5] == "unequal"]
    per_rank = run_ranks(packed_cases.run_packed_matrix, world, cases, repeat, timeout_s=600)
    failures = []
    for case in cases:
        tol = TOL[case[3]]
        for rank, res in enumerate(per_rank):
            errs, zero = res[case]
            if not zero:
                failures.append(f"{case} rank {rank}: padding rows not zero")
            for name, err in errs.items():
                if name == "bitwise":
                    if not err:
                        failures.append(f"{case} rank {rank}: not bitwise repeatable")
                elif not err < tol:  # also catches NaN
                    failures.append(f"{case} rank {rank}: {name} rel err {err:.3g} >= {tol}")
    assert not failures, "\n".join(failures)
    assert any("bitwise" in per_rank[0][c][0] for c in cases)


def _check_packed_references(cases, env):
    """The packed fp32 float64-reference cases on 4 ranks with ``env`` set: every error
    under tolerance and the padding rows' outputs and gradients zero."""
    per_rank = run_ranks(packed_cases.run_packed_matrix, 4, cases, [], timeout_s=600, env=env)
    for case in cases:
        for res in per_rank:
            errs, zero = res[case]
            assert zero and max(errs.values()) < TOL["fp32"], (case, errs)


def test_packed_split_visiting_against_float64_reference():
    """CHARM_SPLIT_VISITING=on under packing: the kv-half sub-tiles are cut by document like
    every tile (2x2, the GQA cases: the byte rule's pass-kv splits)."""
    cases = [(a, t, causal, "fp32", hkv, docs, roles, 8) for a, t, roles, hkv, causal
             in GQA_ROLES[4] if a == "charm" and roles == "bytes" for docs in DOCS]
    _check_packed_references(cases, {"CHARM_SPLIT_VISITING": "on"})


def test_packed_split_counterpart_q_against_float64_reference():
    """CHARM_SPLIT_COUNTERPART_Q=on under packing: the q-half sub-tiles are cut by document
    like every tile (2x2, multi-head attention, the paper's pass-q)."""
    cases = [("charm", "2x2", causal, "fp32", 8, docs, "paper", 8)
             for causal in (True, False) for docs in DOCS]
    _check_packed_references(cases, {"CHARM_SPLIT_COUNTERPART_Q": "on"})


def test_packed_split_counterpart_q_home_against_float64_reference():
    """CHARM_SPLIT_COUNTERPART_Q=home under packing: the same sub-tiles, the partials home on
    the home streams (2x2, multi-head attention, causal, unequal documents)."""
    cases = [("charm", "2x2", True, "fp32", 8, "unequal", "paper", 8)]
    _check_packed_references(cases, {"CHARM_SPLIT_COUNTERPART_Q": "home"})


def test_byte_rule_changes_the_gqa_plans():
    """The GQA role-mix cases above are not the paper's plans twice: for 8 query heads and 2 or
    1 kv heads the byte rule builds other forward and backward plans than Algorithm 1."""
    from charm_megatron.plan.registry import build_plan
    from charm_megatron.plan.roles import RoleShape

    for world, setups in GQA_ROLES.items():
        for algo, topo, roles, hkv, causal in setups:
            if roles != "bytes":
                continue
            n_groups = int(topo.split("x")[0]) if topo else 1
            size = world // n_groups
            groups = [list(range(g * size, (g + 1) * size)) for g in range(n_groups)]
            for direction in ("forward", "backward"):
                paper = build_plan(algo, direction, groups, causal, roles="paper")
                byte = build_plan(algo, direction, groups, causal, roles="bytes",
                                  shape=RoleShape(8, hkv, 8, 4))
                assert byte.ops != paper.ops, (algo, topo, hkv, causal, direction)


def test_packed_messages_are_the_unpacked_ones():
    """Same plans, same message sizes: under causal masking half-block transfers stay
    half-sized with packing (the edge permutation keeps each half contiguous). The role mix
    reaches the packed plans: with 8 query / 1 kv heads the byte rule's messages differ from
    the paper's, packed as unpacked."""
    configs = [(None, 4, 2), ("bytes", 8, 1), ("paper", 8, 1)]
    for rank, res in enumerate(run_ranks(packed_cases.wire_sizes, 4, "charm", "2x2", configs,
                                         timeout_s=120)):
        for config in configs:
            packed, plain = res[config]
            assert packed == plain and packed, (rank, config)
        t = packed_cases.doc_lengths("unequal", 4)[1]
        half_kv = sum(t) // 4 // 2 * 2 * 8  # half a k (or v) block: t/2 rows x 2 heads x 8
        assert half_kv in res[(None, 4, 2)][0], rank
        assert res[("bytes", 8, 1)][0] != res[("paper", 8, 1)][0], rank


BAD = {
    "decreasing": "not increasing",
    "length": "tensors hold",
    "mismatch": "disagree on cu_seqlens \\(real document lengths\\)",
    "padded_multiple": "padded length .* not a multiple of 2\\*cp_size",
    "unpadded_multiple": "no cu_seqlens_padded given.* not a multiple of 2\\*cp_size",
    "padded_shorter": "padded length",
    "float_cu": "must be int32",
    "not_3d": "must be 3-D",
    "roles": "cp_attention: roles='pepper'; choose one of bytes, paper, kv, q",
}


def test_bad_packed_input_raises_on_every_rank():
    errors = run_ranks(packed_cases.run_bad_inputs, 2, sorted(BAD), timeout_s=120)
    for case, pattern in BAD.items():
        got = [e[case] for e in errors]
        assert all(g is not None for g in got), (case, got)
        assert any(re.search(pattern, g) for g in got), (case, got)


# -------------------------------------------------------------------- the failure model
PACKED_MISMATCH = {  # case -> the field the message names
    "algo": "algo",
    "causal": "causal",
    "cu_seqlens": "cu_seqlens \\(real document lengths\\)",
    "dtype": "q shape/dtype",
    "roles": "disagree on roles \\(rank 0: .bytes., rank 1: .paper.\\)",
    "backward_order": "call number",
}


@pytest.mark.parametrize("case", sorted(PACKED_MISMATCH))
def test_packed_mismatch_is_an_error_on_every_rank(case):
    # The same agreement check as unpacked calls (docs/api.md, failure model): every rank
    # raises CPMismatchError naming the field and the odd rank, within the 4 s bound.
    res = run_ranks(packed_cases.packed_mismatch, 2, case, timeout_s=90)
    if case == "backward_order":
        # Calls pair by number: rank 0, in call 0's backward, is behind rank 1 (call 1's)
        # and raises at once naming the call numbers; rank 1 waits for rank 0's next
        # exchange and raises within its bound when rank 0 stops instead.
        assert res[0][0] == "CPMismatchError" and re.search("call number", res[0][1]), res
        assert res[1][0] in ("CPAttentionError", "CPMismatchError"), res
        assert max(took for _, _, took in res) < 20, res
        return
    for rank, (kind, text, took) in enumerate(res):
        assert kind == "CPMismatchError", (rank, kind, text)
        assert re.search(PACKED_MISMATCH[case], text), (rank, text)
        assert "rank 1" in text, (rank, text)
        assert took < 20, (rank, took)


@pytest.mark.parametrize("algo,topology,world", [("ring", None, 2), ("charm", "2x2", 4)])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_packed_kernel_failure_mid_call_then_normal_call(algo, topology, world, where):
    bad = world - 1
    res = run_ranks(packed_cases.packed_failure_then_normal_call, world, algo, topology, where,
                    bad, timeout_s=120)
    check_clean_failure(res, bad, algo, where)


# ------------------------------------------------------------------ single-process pieces
def test_thd_shard_is_megatrons_layout_and_unshard_inverts_it():
    cup = torch.tensor([0, 8, 12, 28], dtype=torch.int32)  # cp=2: chunks of 2, 1, 4
    x = torch.arange(28)
    assert thd_shard(x, cup, 0, 2).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 15, 24, 25, 26, 27]
    assert thd_index(1, 2, cup).tolist() == [2, 3, 4, 5, 9, 10, 16, 17, 18, 19, 20, 21, 22, 23]
    parts = [thd_shard(x, cup, r, 2) for r in range(2)]
    assert torch.equal(thd_unshard(parts, cup), x)
    cu = torch.tensor([0, 5, 8, 20], dtype=torch.int32)
    y = torch.randn(20, 3)
    assert torch.equal(thd_unpad(thd_pad(y, cu, cup), cu, cup), y)
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size"):
        thd_index(0, 4, cup)


def test_internal_halves_are_the_first_and_second_chunks_of_every_document():
    layout = make_layout(torch.tensor([0, 7, 9], dtype=torch.int32),
                         torch.tensor([0, 8, 12], dtype=torch.int32), 2, 6)
    perm = layout.permutation()
    for r in range(2):
        pos = thd_index(r, 2, [0, 8, 12])[torch.tensor(perm)]
        first, second = pos[:3].tolist(), pos[3:].tolist()
        assert first == [2 * r, 2 * r + 1, 8 + r]  # chunk r of both documents
        j = 3 - r
        assert second == [2 * j, 2 * j + 1, 8 + j]  # chunk 2cp-1-r of both documents


def test_tile_segments_follow_documents_and_skip_padding():
    # cp=2, documents of real length 7 (padded 8, chunks of 2) and 1 (padded 4, chunks of 1).
    layout = THDLayout(2, (7, 1), (8, 4))
    diag = tile_segments(layout, tile_spec(1, 1, True), torch.device("cpu"))
    # rank 1: doc0 chunk1 rows 0,1 (positions 2,3) and chunk2 rows 3,4 (positions 4,5); doc1's
    # chunks 1 and 2 are padding.
    assert diag.q_index.tolist() == [0, 1, 3, 4] and diag.cu_q == (0, 4) and diag.causal
    earlier = tile_segments(layout, tile_spec(1, 0, True), torch.device("cpu"))
    # q rank 1 (all rows) vs the first half of kv rank 0: doc0 positions 0,1; doc1 position 0,
    # but doc1 has no real q rows on rank 1 -> dropped.
    assert earlier.k_index.tolist() == [0, 1] and earlier.cu_q == (0, 4) and not earlier.causal
    later = tile_segments(layout, tile_spec(0, 1, True), torch.device("cpu"))
    # second q half of rank 0 (chunk 3: doc0 positions 6 only real) vs all of kv rank 1.
    assert later.q_index.tolist() == [0] and later.k_index.tolist() == [0, 1, 3, 4]
    assert tile_spec(0, 1, True).q_half is Half.SECOND


def test_bench_packed_documents_fill_the_tokens_and_are_seeded():
    from charm_megatron.lab.bench.config import BenchConfig, HeadSpec
    from charm_megatron.lab.bench.packing import doc_lengths

    real, padded = doc_lengths(8192, 8, 512, seed=3)
    assert sum(padded) == 8192 and all(p % 16 == 0 and 1 <= r <= p for r, p in zip(real, padded))
    assert len(real) > 4 and len(set(real)) > 2  # several documents of different lengths
    assert doc_lengths(8192, 8, 512, seed=3) == (real, padded)
    assert doc_lengths(8192, 8, 512, seed=4) != (real, padded)
    cfg = BenchConfig([1], [96, 100], [HeadSpec(2, 8)], causal=False, packed_mean=16)
    points, dropped = cfg.points(4)
    assert [p.seq for p in points] == [96] and "packed" in dropped[0]
