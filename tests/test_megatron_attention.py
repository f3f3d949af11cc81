"""``CharmDotProductAttention`` as a module: construction checks, loud errors, the start-up
line (``describe_model``), CP size 1, and ``auto``. One 2-rank gloo job gathers every check;
the parent asserts."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

from charm_megatron.local_ranks import run_ranks

pytest.importorskip("megatron.core")

from test_megatron_model import (  # noqa: E402
    SEQ,
    _config,
    _cpu_megatron,
    _init_parallel,
    _losses,
    _model,
)


def _outcome(fn) -> tuple[str, str]:
    """("ok", "") or (exception type name, message) of calling ``fn``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects whatever was raised
        return type(exc).__name__, str(exc)
    return "ok", ""


def _rank_checks(rank: int, world: int) -> dict:
    _cpu_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnMaskType

    from charm_megatron.megatron import CharmDotProductAttention
    from charm_megatron.megatron.build import print_model_description

    out: dict = {}
    singles = [dist.new_group([r]) for r in range(world)]  # every rank, same order

    # ---- CP=2: the start-up line, then construction errors.
    _init_parallel(1, 2)
    pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    config = _config(1, 2, 2)

    def build(cfg=config, **kw):
        args = dict(config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                    attention_type="self", cp_comm_type="charm", softmax_scale=None,
                    pg_collection=pgs)
        args.update(kw)
        return CharmDotProductAttention(**args)

    text = io.StringIO()
    layers = torch.nn.ModuleList([build(layer_number=1, topology="2x1"),
                                  build(layer_number=2, topology="2x1")])
    with contextlib.redirect_stdout(text):
        print_model_description(layers)  # two layers, one line
        print_model_description(torch.nn.ModuleList(
            [build(layer_number=1, topology="2x1"), build(layer_number=2, cp_comm_type="ring")]))
    out["log"] = text.getvalue()

    def with_config(**changes):
        cfg = _config(1, 2, 2)
        for k, v in changes.items():
            object.__setattr__(cfg, k, v)  # skip TransformerConfig's own validation
        return cfg

    out["p2p_algo"] = build(cp_comm_type="p2p").algo  # TE's p2p without TE: our ring
    out["allgather_algo"] = build(cp_comm_type="allgather").algo
    out["a2a_algo"] = build(cp_comm_type="a2a").algo  # TE's a2a without TE: our Ulysses
    out["a2a_p2p_algo"] = build(cp_comm_type="a2a+p2p", topology="1x2").algo
    # --hierarchical-context-parallel-sizes A P: P groups of A consecutive ranks.
    out["a2a_p2p_sizes"] = str(build(with_config(hierarchical_context_parallel_sizes=[1, 2]),
                                     cp_comm_type="a2a+p2p").topology)
    out["bogus"] = _outcome(lambda: build(cp_comm_type="bogus"))
    out["none_is_charm"] = build(cp_comm_type=None).algo
    # megatron-core's rule: a window on every layer but each window_attn_skip_freq-th.
    out["windows"] = [build(with_config(window_size=(16, 0), window_attn_skip_freq=2),
                            layer_number=n).window_size for n in (1, 2, 3)]
    out["softmax_type"] = _outcome(lambda: build(with_config(softmax_type="softer")))
    learnable = build(with_config(softmax_type="learnable"))
    out["learnable_offset"] = (type(learnable.softmax_offset).__name__,
                               tuple(learnable.softmax_offset.shape),
                               sorted(learnable.state_dict()))
    off_by_one = build(with_config(softmax_type="off-by-one"))
    out["off_by_one_offset"] = (off_by_one.softmax_offset.tolist(), sorted(off_by_one.state_dict()))
    out["fp8"] = _outcome(lambda: build(with_config(fp8_dot_product_attention=True)))
    out["qk_clip"] = _outcome(lambda: build(with_config(qk_clip=True)))
    out["cuda_graph"] = _outcome(lambda: build(with_config(cuda_graph_impl="local")))
    out["cuda_graph_mlp"] = _outcome(
        lambda: build(with_config(cuda_graph_impl="transformer_engine", cuda_graph_scope=["mlp"]))
    )
    out["padding"] = _outcome(lambda: build(attn_mask_type=AttnMaskType.padding))
    out["cross"] = _outcome(lambda: build(attention_type="cross"))
    out["te_kwarg"] = _outcome(lambda: build(num_splits=2))
    out["group_size"] = _outcome(
        lambda: build(pg_collection=ProcessGroupCollection(tp=pgs.tp, cp=singles[rank]))
    )
    out["topology_size"] = _outcome(lambda: build(topology="2x2"))
    out["empty_topology"] = _outcome(lambda: build(topology=" "))
    # Precedence: topology= (--charm-topology) > CHARM_TOPOLOGY > probe; ring/rmplus: flat.
    os.environ["CHARM_TOPOLOGY"] = "2x1"
    out["env_topology"] = str(build().topology), str(build(cp_comm_type="rmplus").topology)
    out["set_beats_env"] = str(build(topology="1x2").topology)
    del os.environ["CHARM_TOPOLOGY"]
    # The CHARM_* settings are read once, at build (CPOptions.from_env), and the CP group's
    # stream communicators are made there too (every rank builds the layer together).
    from charm_megatron.ops import streams

    os.environ["CHARM_PASS_ORDER"] = "joint"
    joint = build(topology="flat")
    del os.environ["CHARM_PASS_ORDER"]
    out["options_at_build"] = joint.options.pass_order, build(topology="flat").options.pass_order
    out["eager_streams"] = streams._key(pgs.cp) in streams._CACHE

    # ---- forward-time errors (and what works).
    torch.manual_seed(0)
    q = torch.randn(SEQ // 2, 2, 4, 16)
    k = torch.randn(SEQ // 2, 2, 2, 16)
    v = torch.randn(SEQ // 2, 2, 2, 16)
    attn = build(topology="flat")
    out["packed"] = _outcome(
        lambda: attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="bshd"))
    )
    out["packed_sbhd"] = _outcome(
        lambda: attn(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    )
    out["local_cp_size_2"] = _outcome(
        lambda: attn(q, k, v, None, packed_seq_params=PackedSeqParams(local_cp_size=2))
    )
    out["bias"] = _outcome(lambda: attn(q, k, v, None, attention_bias=torch.zeros(1)))
    out["kv_cache"] = _outcome(lambda: attn(q[:1], k, v, None))
    out["not_4d"] = _outcome(lambda: attn(q[:, 0], k, v, None))
    out["dtypes_differ"] = _outcome(lambda: attn(q.double(), k, v, None))
    # Built with CHARM_PASS_ORDER=joint: the forward runs joint whatever the variable says now.
    out["joint_err"] = (joint(q, k, v, None) - attn(q, k, v, None)).abs().max().item()
    dropout = build(attention_dropout=0.1, topology="flat")
    out["dropout_train"] = _outcome(lambda: dropout(q, k, v, None))
    dropout.eval()
    out["dropout_eval"] = _outcome(lambda: dropout(q, k, v, None))
    ring = build(cp_comm_type="ring")(q, k, v, None)
    out["shape"] = tuple(ring.shape)
    out["auto_build"] = _outcome(lambda: build(cp_comm_type="auto", topology="flat"))
    if out["auto_build"][0] == "ok":
        auto = build(cp_comm_type="auto", topology="flat")
        out["auto_err"] = (auto(q, k, v, None) - ring).abs().max().item()
    # Query-key layer scaling does not change the attention (Megatron's own identity).
    scaled = build(with_config(apply_query_key_layer_scaling=True), layer_number=3,
                   topology="flat")
    out["qk_scaling_err"] = (scaled(q, k, v, None) - ring).abs().max().item()

    # ---- no CP group at all, CP size 2.
    ps.destroy_model_parallel()
    out["no_group"] = _outcome(
        lambda: build(pg_collection=ProcessGroupCollection(tp=singles[rank]))
    )

    # ---- a whole GPTModel with Megatron's p2p and the local spec (no TE core attention): our
    # ring serves it instead of the local DotProductAttention's refusal of CP; a2a likewise
    # (our Ulysses).
    _init_parallel(1, 2)
    out["model_p2p"] = _outcome(lambda: _model(_config(1, 2, 2, cp_comm_type="p2p"), charm=True))
    out["model_a2a"] = _outcome(lambda: _model(_config(1, 2, 2, cp_comm_type="a2a"), charm=True))

    # ---- CP size 1 (DP=2 here): CHARM+ is local attention, equal to Megatron's own.
    _init_parallel(1, 1)
    stock = _model(_config(1, 1, 2), charm=False)
    charm = _model(_config(1, 1, 2), charm=True)
    charm.load_state_dict(stock.state_dict())
    out["cp1_err"] = (
        (_losses(charm, 0, reference=False) - _losses(stock, 0, reference=True)).abs().max().item()
    )
    out["cp1_algo"] = charm.decoder.layers[0].self_attention.core_attention.algo
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_rank_checks, 2, timeout_s=180)


def _err(results, key: str, kind: str, *phrases: str) -> None:
    for rank, res in enumerate(results):
        got_kind, msg = res[key]
        assert got_kind == kind, (rank, key, res[key])
        for p in phrases:
            assert p in msg, (rank, key, p, msg)


def test_startup_line_once_on_rank0(results):
    assert results[0]["log"] == (
        "charm-megatron: cp_comm_type=charm cp_size=2 topology=2x1 groups=[[0],[1]] cp_ranks=0,1\n"
        "charm-megatron: cp_comm_type=charm cp_size=2 topology=2x1 groups=[[0],[1]] cp_ranks=0,1"
        " layers=1\n"
        "charm-megatron: cp_comm_type=ring cp_size=2 topology=1x2 groups=[[0,1]] cp_ranks=0,1"
        " layers=2\n"
    )
    assert results[1]["log"] == ""


def test_comm_types(results):
    assert all(r["p2p_algo"] == "ring" and r["allgather_algo"] == "allgather" for r in results)
    assert all(r["a2a_algo"] == "a2a" and r["a2a_p2p_algo"] == "a2a+p2p" for r in results)
    assert all(r["a2a_p2p_sizes"] == "2x1" for r in results)
    _err(results, "bogus", "ValueError", "cp_comm_type 'bogus'")
    # p2p and a2a ran on ours where the local spec's DotProductAttention would refuse CP.
    for key in ("model_p2p", "model_a2a"):
        assert all(r[key] == ("ok", "") for r in results), [r[key] for r in results]
    assert all(r["none_is_charm"] == "charm" for r in results)


def test_misconfigured_groups_and_topology(results):
    _err(results, "no_group", "RuntimeError", "context_parallel_size=2",
         "needs a context-parallel process group")
    _err(results, "group_size", "RuntimeError", "CP process group has 1 ranks",
         "context_parallel_size is 2")
    _err(results, "topology_size", "ValueError", "2x2", "has 4 ranks but the CP group has 2")
    _err(results, "empty_topology", "ValueError", "empty topology")
    for res in results:
        assert res["env_topology"] == ("2x1", "1x2")  # charm reads CHARM_TOPOLOGY; rmplus flat
        assert res["set_beats_env"] == "1x2"
        assert res["options_at_build"] == ("joint", "split")
        assert res["eager_streams"]


def test_unsupported_options_name_the_option(results):
    assert all(r["windows"] == [(16, 0), None, (16, 0)] for r in results), results[0]["windows"]
    _err(results, "softmax_type", "NotImplementedError", "--softmax-type", "off-by-one")
    # Where megatron-core's DotProductAttention keeps the offset: a parameter [heads / tp]
    # named softmax_offset (learnable), a plain zero tensor outside the state dict (off-by-one).
    assert all(r["learnable_offset"] == ("Parameter", (4,), ["softmax_offset"]) for r in results)
    assert all(r["off_by_one_offset"] == ([0.0] * 4, []) for r in results)
    _err(results, "fp8", "NotImplementedError", "--fp8-dot-product-attention")
    _err(results, "qk_clip", "NotImplementedError", "--qk-clip")
    _err(results, "cuda_graph", "NotImplementedError", "--cuda-graph-impl", "whole layer")
    assert all(r["cuda_graph_mlp"] == ("ok", "") for r in results)
    _err(results, "padding", "NotImplementedError", "attn_mask_type=padding")
    _err(results, "cross", "NotImplementedError", "attention_type='cross'")
    _err(results, "te_kwarg", "NotImplementedError", "num_splits")
    _err(results, "packed", "NotImplementedError", "packed_seq_params", "qkv_format='bshd'")
    _err(results, "local_cp_size_2", "ValueError", "local_cp_size=2 without a cp_group")
    assert all(r["packed_sbhd"] == ("ok", "") for r in results)
    _err(results, "bias", "NotImplementedError", "attention_bias")
    _err(results, "kv_cache", "NotImplementedError", "KV cache")
    _err(results, "not_4d", "ValueError", "CharmDotProductAttention: q must be 4-D")
    _err(results, "dtypes_differ", "TypeError", "CharmDotProductAttention: q, k, v dtypes differ")
    assert all(r["joint_err"] < 1e-5 for r in results)
    _err(results, "dropout_train", "NotImplementedError", "--attention-dropout")
    assert all(r["dropout_eval"] == ("ok", "") for r in results)


def test_forward_shape_and_qk_layer_scaling(results):
    for res in results:
        assert res["shape"] == (SEQ // 2, 2, 64)
        assert res["qk_scaling_err"] < 1e-6


def test_auto_builds_and_matches_ring(results):
    """``auto`` (a registry choice, so accepted by the layer and by cp_attention) gives ring's
    result."""
    for res in results:
        assert res["auto_build"] == ("ok", "") and res["auto_err"] < 1e-6


def test_cp_size_1_is_local_attention(results):
    for res in results:
        assert res["cp1_algo"] == "charm"
        assert res["cp1_err"] < 1e-5
