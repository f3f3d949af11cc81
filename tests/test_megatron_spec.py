"""``use_charm`` on megatron-core's own layer and block specs, and the argument helpers.

No process group is needed: specs are plain data.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("megatron.core")

from megatron.core.models.backends import LocalSpecProvider  # noqa: E402
from megatron.core.models.gpt import gpt_layer_specs  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
)
from megatron.core.transformer.attention import (  # noqa: E402
    CrossAttention,
    CrossAttentionSubmodules,
    SelfAttention,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.multi_token_prediction import (  # noqa: E402
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron.core.transformer.spec_utils import ModuleSpec  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from charm_megatron.megatron import (  # noqa: E402
    CHARM_COMM_TYPES,
    CharmDotProductAttention,
    PerLayerCoreAttention,
    add_charm_args,
    chain_extra_args_providers,
    charm_comm_types,
    count_charm_attention,
    our_comm_types,
    use_charm,
    uses_charm,
)


def _core(layer_spec):
    return layer_spec.submodules.self_attention.submodules.core_attention


def _is_selector(slot, original, topology=None) -> bool:
    """``slot`` is use_charm's per-layer choice keeping ``original`` for Megatron's values."""
    return (
        isinstance(slot, ModuleSpec)
        and slot.module is PerLayerCoreAttention
        and slot.params == {"original": original, "topology": topology}
    )


def _moe_config(num_layers: int = 4) -> TransformerConfig:
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        num_moe_experts=4,
        moe_layer_freq=2,
        moe_ffn_hidden_size=64,
        use_cpu_initialization=True,
    )


# --------------------------------------------------------------------------- use_charm
def test_local_spec_gets_charm_and_input_is_untouched():
    spec = get_gpt_layer_local_spec()
    out = use_charm(spec)
    assert _core(spec) is DotProductAttention  # the caller's spec is not modified
    assert _is_selector(_core(out), DotProductAttention)
    assert out.submodules.self_attention is not spec.submodules.self_attention
    # Everything else is the stock spec.
    sa, sa0 = out.submodules.self_attention, spec.submodules.self_attention
    assert sa.module is SelfAttention and sa.params == {"attn_mask_type": AttnMaskType.causal}
    assert sa.submodules.linear_qkv is sa0.submodules.linear_qkv
    assert sa.submodules.linear_proj is sa0.submodules.linear_proj
    assert out.submodules.mlp == spec.submodules.mlp
    assert out.submodules.input_layernorm is spec.submodules.input_layernorm


def test_use_charm_is_idempotent():
    once = use_charm(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    twice = use_charm(once)
    assert twice == once and twice is not once
    assert _is_selector(_core(twice), DotProductAttention)
    # A topology given again replaces the earlier one, on a copy.
    again = use_charm(twice, topology="2x4")
    assert _is_selector(_core(again), DotProductAttention, topology="2x4")
    assert _is_selector(_core(twice), DotProductAttention)
    assert _is_selector(_core(use_charm(get_gpt_layer_local_spec(), topology=" flat ")),
                        DotProductAttention, topology="flat")
    with pytest.raises(ValueError, match="empty topology"):
        use_charm(once, topology=" ")


def test_moe_layer_and_decoder_block_spec():
    moe = use_charm(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
    assert _is_selector(_core(moe), DotProductAttention)
    assert moe.submodules.mlp.module.__name__ == "MoELayer"

    block = get_gpt_decoder_block_spec(_moe_config(), use_transformer_engine=False, pp_rank=0)
    out = use_charm(block)
    assert isinstance(out, TransformerBlockSubmodules) and len(out.layer_specs) == 4
    assert all(_is_selector(_core(s), DotProductAttention) for s in out.layer_specs)
    assert all(_core(s) is DotProductAttention for s in block.layer_specs)
    # Dense and MoE layers alternate (moe_layer_freq=2) and the aliasing is preserved.
    assert out.layer_specs[0] is out.layer_specs[2] and out.layer_specs[0] is not out.layer_specs[1]
    assert count_charm_attention(out) == 2  # two distinct layer spec objects
    assert count_charm_attention(block) == 0


def test_mtp_block_spec():
    mtp_layer = get_mtp_layer_spec_for_backend(get_gpt_layer_local_spec(), backend=LocalSpecProvider())
    mtp = MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer])
    out = use_charm(mtp)
    assert _is_selector(_core(out.layer_specs[0].submodules.transformer_layer), DotProductAttention)


def test_transformer_engine_spec(monkeypatch):
    """The real ``get_gpt_layer_with_transformer_engine_spec`` without TE installed.

    megatron-core 0.16.1 only binds ``TESpecProvider`` / ``TENorm`` in gpt_layer_specs when
    ``import transformer_engine`` succeeds, so the function raises NameError here. Its
    ``megatron.core.extensions`` modules do import without TE (TE classes become placeholders),
    so we bind those names and pretend a recent TE version: the result is the genuine TE spec
    structure with placeholder classes.
    """
    import megatron.core.extensions.transformer_engine as te
    import megatron.core.extensions.transformer_engine_spec_provider as provider

    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te.TENorm, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TEFusedMLP", te.TEFusedMLP, raising=False)

    te_attention = provider.TESpecProvider().core_attention()
    for spec in (
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(),
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True),
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=4, moe_grouped_gemm=True
        ),
    ):
        assert _core(spec) is te_attention
        out = use_charm(spec)
        assert _is_selector(_core(out), te_attention)
        assert type(out.submodules.self_attention.submodules.linear_qkv) is type(
            spec.submodules.self_attention.submodules.linear_qkv
        )
        assert out.submodules.sharded_state_dict_keys_map == spec.submodules.sharded_state_dict_keys_map

    block = get_gpt_decoder_block_spec(_moe_config(), use_transformer_engine=True, pp_rank=0)
    out = use_charm(block)
    assert all(_is_selector(_core(s), te_attention) for s in out.layer_specs)


def test_cross_attention_is_left_alone():
    layer = get_gpt_layer_local_spec()
    cross = ModuleSpec(
        module=CrossAttention,
        params={"attn_mask_type": AttnMaskType.padding},
        submodules=CrossAttentionSubmodules(
            linear_q=object, linear_kv=object, core_attention=DotProductAttention,
            linear_proj=object,
        ),
    )
    layer = dataclasses.replace(
        layer, submodules=dataclasses.replace(layer.submodules, cross_attention=cross)
    )
    out = use_charm(layer)
    assert _is_selector(_core(out), DotProductAttention)
    assert out.submodules.cross_attention.submodules.core_attention is DotProductAttention


def test_self_attention_spec_by_import_path_and_bare():
    """A ``ModuleSpec`` may name its module as ``(module_path, name)``; a bare SelfAttention
    spec (not inside a layer) is handled too."""
    sa = get_gpt_layer_local_spec().submodules.self_attention
    by_path = dataclasses.replace(sa, module=("megatron.core.transformer.attention", "SelfAttention"))
    assert _is_selector(use_charm(by_path).submodules.core_attention, DotProductAttention)
    assert _is_selector(use_charm(sa).submodules.core_attention, DotProductAttention)
    assert _is_selector(use_charm([sa, sa])[0].submodules.core_attention, DotProductAttention)


def test_multi_latent_attention_gets_the_selector():
    spec = use_charm(get_gpt_layer_local_spec(multi_latent_attention=True))
    assert _is_selector(spec.submodules.self_attention.submodules.core_attention,
                        DotProductAttention)


def test_subclass_of_charm_is_kept():
    class Custom(CharmDotProductAttention):
        pass

    spec = use_charm(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = Custom
    assert _core(use_charm(spec)) is Custom
    with_topology = _core(use_charm(spec, topology="2x2"))
    assert with_topology.module is Custom and with_topology.params == {"topology": "2x2"}


# --------------------------------------------------------------------------- arguments
def test_add_charm_args_and_chain():
    def theirs(parser):
        parser.add_argument("--their-flag", type=int, default=0)
        return parser

    parser = argparse.ArgumentParser()
    parser.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"])
    provider = chain_extra_args_providers(add_charm_args, None, theirs)
    assert provider(parser) is parser
    add_charm_args(parser)  # idempotent: no "conflicting option string" error
    args = parser.parse_args(["--cp-comm-type", "charm", "--charm-topology", "2x8", "--their-flag", "3"])
    assert (args.cp_comm_type, args.charm_topology, args.their_flag) == (["charm"], "2x8", 3)
    assert parser.parse_args([]).charm_topology is None


def test_charm_comm_types_rules():
    assert our_comm_types() == CHARM_COMM_TYPES == ("ring", "rmplus", "charm", "auto")
    assert set(our_comm_types()) >= {"charm", "rmplus", "ring", "auto"}
    assert charm_comm_types(["charm"]) == ("charm",)
    assert charm_comm_types("rmplus") == ("rmplus",)
    assert charm_comm_types(["ring", "ring", "ring"]) == ("ring",)
    assert charm_comm_types(["p2p"]) == () and charm_comm_types(None) == ()
    assert charm_comm_types(["a2a", "p2p"]) == ()
    # Per-layer lists may mix ours with Megatron's, and ours with each other.
    assert charm_comm_types(["charm", "p2p", "ring", "charm"]) == ("charm", "ring")
    assert uses_charm(argparse.Namespace(cp_comm_type=["auto"]))
    assert uses_charm(argparse.Namespace(cp_comm_type=["a2a", "rmplus"]))
    assert not uses_charm(argparse.Namespace(cp_comm_type=["p2p"]))
    assert not uses_charm(argparse.Namespace())


def test_layer_comm_type_rule_and_megatron_0_16_list():
    """Layer L gets entry L-1; past the end (MTP layers) the last; PerLayerCommTypes answers
    megatron-core 0.16.1's off-by-one read (entry L) without IndexError."""
    from charm_megatron.megatron.comm_types import PerLayerCommTypes, fix_per_layer_list
    from charm_megatron.megatron.comm_types import layer_comm_type as lct

    values = ["ring", "a2a", "charm"]
    assert [lct(values, n) for n in (1, 2, 3, 4)] == ["ring", "a2a", "charm", "charm"]
    assert lct("rmplus", 7) == "rmplus" and lct(None, 1) is None and lct(None, 1, "p2p") == "p2p"
    assert lct(values, 2, passed="charm") == "a2a"  # the config wins over what 0.16.1 passed
    with pytest.raises(ValueError, match="1-based"):
        lct(values, 0)
    fixed = PerLayerCommTypes(values)
    assert fixed == values and isinstance(fixed, list) and len(fixed) == 3
    assert fixed[3] == "charm" and fixed[1] == "a2a" and fixed[-1] == "charm"
    assert fixed[0:2] == ["ring", "a2a"]
    with pytest.raises(IndexError):
        values[3]  # what 0.16.1's TransformerLayer does with a plain list in its last layer
    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=4,
                               context_parallel_size=2, cp_comm_type=list(values),
                               use_cpu_initialization=True)
    assert type(fix_per_layer_list(config).cp_comm_type) is PerLayerCommTypes


def test_add_charm_args_names_our_values_in_cp_comm_type_help():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cp-comm-type", nargs="+", type=str, default=["p2p"],
                        help="Inter-gpu communication type: p2p, a2a, allgather or a2a+p2p.")
    add_charm_args(parser)
    add_charm_args(parser)  # idempotent: the help is extended once
    text = parser.format_help()
    action = next(a for a in parser._actions if "--cp-comm-type" in a.option_strings)
    assert action.help.count("charm-megatron adds") == 1
    for name in our_comm_types():
        assert name in action.help, name
    assert "--charm-topology" in text


def test_args_module_imports_no_torch():
    """The launcher reads arguments before Megatron is imported: args.py must stay light."""
    import subprocess
    import sys

    code = (
        "import sys; import charm_megatron.megatron.args, charm_megatron.pretrain_gpt; "
        "bad = [m for m in ('torch', 'megatron') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- --spec route
def test_layer_specs_load_the_way_megatron_spec_does(monkeypatch):
    """Megatron-LM core_v0.16.1's ``--spec MODULE NAME`` is ``import_module((MODULE, NAME))``
    (gpt_builders.py:44-45), which returns the named object itself."""
    from megatron.core.transformer.spec_utils import build_module, import_module

    from charm_megatron.megatron import layer_specs

    local = import_module(("charm_megatron.megatron.layer_specs", "charm_local_layer_spec"))
    assert local is layer_specs.charm_local_layer_spec
    assert _is_selector(_core(local), DotProductAttention)
    assert local == layer_specs.local_layer_spec() and local.module.__name__ == "TransformerLayer"

    te_spec = import_module(("charm_megatron.megatron.layer_specs", "charm_te_layer_spec"))
    try:
        import transformer_engine  # noqa: F401
    except ImportError:  # this machine: a spec that says what is missing when built
        with pytest.raises(ImportError, match="needs Transformer Engine"):
            build_module(te_spec)
    # The TE variant's structure, with megatron-core's TE names bound as in
    # test_transformer_engine_spec.
    import megatron.core.extensions.transformer_engine as te
    import megatron.core.extensions.transformer_engine_spec_provider as provider

    monkeypatch.setattr(provider, "is_te_min_version", lambda *a, **k: True)
    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", provider.TESpecProvider, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TENorm", te.TENorm, raising=False)
    monkeypatch.setattr(gpt_layer_specs, "TEFusedMLP", te.TEFusedMLP, raising=False)
    built = layer_specs.te_layer_spec(topology="2x4")
    assert _is_selector(_core(built), provider.TESpecProvider().core_attention(), topology="2x4")


def test_only_the_local_core_attention_is_replaced_for_te_comm_types():
    """TE's p2p / allgather are served by ours only where the spec's core attention is
    megatron-core's local DotProductAttention (which refuses CP); TE's, or a user's own, is
    kept (PerLayerCoreAttention, docs/megatron.md)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from charm_megatron.megatron.args import stand_in
    from charm_megatron.megatron.selector import refuses_cp

    class TEDotProductAttention:  # stands for TE's (same name, not the local module)
        pass

    path = "megatron.core.transformer.dot_product_attention.DotProductAttention"
    assert refuses_cp(DotProductAttention) and refuses_cp(ModuleSpec(module=DotProductAttention))
    assert refuses_cp(path)
    assert not refuses_cp(TEDotProductAttention)
    assert not refuses_cp(ModuleSpec(module=TEDotProductAttention))
    assert not refuses_cp("megatron.core.extensions.transformer_engine.TEDotProductAttention")
    assert [stand_in(c) for c in ("p2p", "allgather", "a2a", "a2a+p2p", "charm", None)] == [
        "ring", "allgather", "a2a", "a2a+p2p", None, None]
