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
    add_charm_args,
    chain_extra_args_providers,
    charm_comm_type,
    count_charm_attention,
    use_charm,
    uses_charm,
)


def _core(layer_spec):
    return layer_spec.submodules.self_attention.submodules.core_attention


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
    assert _core(out) is CharmDotProductAttention
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
    assert _core(twice) is CharmDotProductAttention


def test_moe_layer_and_decoder_block_spec():
    moe = use_charm(get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False))
    assert _core(moe) is CharmDotProductAttention
    assert moe.submodules.mlp.module.__name__ == "MoELayer"

    block = get_gpt_decoder_block_spec(_moe_config(), use_transformer_engine=False, pp_rank=0)
    out = use_charm(block)
    assert isinstance(out, TransformerBlockSubmodules) and len(out.layer_specs) == 4
    assert all(_core(s) is CharmDotProductAttention for s in out.layer_specs)
    assert all(_core(s) is DotProductAttention for s in block.layer_specs)
    # Dense and MoE layers alternate (moe_layer_freq=2) and the aliasing is preserved.
    assert out.layer_specs[0] is out.layer_specs[2] and out.layer_specs[0] is not out.layer_specs[1]
    assert count_charm_attention(out) == 2  # two distinct layer spec objects
    assert count_charm_attention(block) == 0


def test_mtp_block_spec():
    mtp_layer = get_mtp_layer_spec_for_backend(get_gpt_layer_local_spec(), backend=LocalSpecProvider())
    mtp = MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer])
    out = use_charm(mtp)
    assert _core(out.layer_specs[0].submodules.transformer_layer) is CharmDotProductAttention


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
        assert _core(out) is CharmDotProductAttention
        assert type(out.submodules.self_attention.submodules.linear_qkv) is type(
            spec.submodules.self_attention.submodules.linear_qkv
        )
        assert out.submodules.sharded_state_dict_keys_map == spec.submodules.sharded_state_dict_keys_map

    block = get_gpt_decoder_block_spec(_moe_config(), use_transformer_engine=True, pp_rank=0)
    out = use_charm(block)
    assert all(_core(s) is CharmDotProductAttention for s in out.layer_specs)


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
    assert _core(out) is CharmDotProductAttention
    assert out.submodules.cross_attention.submodules.core_attention is DotProductAttention


def test_self_attention_spec_by_import_path_and_bare():
    """A ``ModuleSpec`` may name its module as ``(module_path, name)``; a bare SelfAttention
    spec (not inside a layer) is handled too."""
    sa = get_gpt_layer_local_spec().submodules.self_attention
    by_path = dataclasses.replace(sa, module=("megatron.core.transformer.attention", "SelfAttention"))
    assert use_charm(by_path).submodules.core_attention is CharmDotProductAttention
    assert use_charm(sa).submodules.core_attention is CharmDotProductAttention
    assert use_charm([sa, sa])[0].submodules.core_attention is CharmDotProductAttention


def test_multi_latent_attention_raises():
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    with pytest.raises(ValueError, match="multi-latent attention"):
        use_charm(spec)


def test_subclass_of_charm_is_kept():
    class Custom(CharmDotProductAttention):
        pass

    spec = use_charm(get_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = Custom
    assert _core(use_charm(spec)) is Custom


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


def test_charm_comm_type_rules():
    assert CHARM_COMM_TYPES == ("ring", "rmplus", "charm", "auto")  # the registry's choices
    assert charm_comm_type(["charm"]) == "charm"
    assert charm_comm_type("rmplus") == "rmplus"
    assert charm_comm_type(["ring", "ring", "ring"]) == "ring"
    assert charm_comm_type(["p2p"]) is None and charm_comm_type(None) is None
    assert charm_comm_type(["a2a", "p2p"]) is None
    with pytest.raises(ValueError, match="cannot be mixed"):
        charm_comm_type(["charm", "p2p"])
    with pytest.raises(ValueError, match="per-layer"):
        charm_comm_type(["charm", "ring"])
    assert uses_charm(argparse.Namespace(cp_comm_type=["auto"]))
    assert not uses_charm(argparse.Namespace(cp_comm_type=["p2p"]))
    assert not uses_charm(argparse.Namespace())


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
