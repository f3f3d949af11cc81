"""A real megatron-core GPTModel with CHARM+ attention on CPU ranks matches the same model at CP=1.

Each test is one multi-rank job (``run_ranks``, gloo). Inside a rank:

1. the reference: megatron-core's stock local spec (its own ``DotProductAttention``) at CP=1,
   fed the whole sequence;
2. the same weights (``load_state_dict``) in a model built from ``use_charm(spec)`` at CP>1, fed
   through megatron-core's own load-balanced split (``megatron.core.utils.
   get_batch_on_this_cp_rank``, what ``pretrain_gpt.get_batch`` calls);
3. per-token losses, and every parameter gradient after the CP/DP all-reduce Megatron's
   ``finalize_model_grads`` would do, are compared.

megatron-core assumes CUDA in a few places that a CPU run reaches; ``_cpu_megatron`` redirects
exactly those (documented there). fp32 throughout.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

from charm_megatron.local_ranks import run_ranks
from charm_megatron.train_demo.cpu_megatron import (
    cpu_config_kwargs,
    init_parallel,
    patch_for_cpu,
)

pytest.importorskip("megatron.core")

SEQ, BATCH, VOCAB = 64, 2, 128
LOSS_TOL = 1e-5  # per-token loss, absolute
GRAD_TOL = 1e-4  # parameter gradient, relative norm


# --------------------------------------------------------------------------- CPU scaffolding
def _cpu_megatron() -> None:
    """Make megatron-core run on a CPU-only torch (RoPE, CP slice, RNG tracker; see
    charm_megatron.train_demo.cpu_megatron)."""
    patch_for_cpu()


def _init_parallel(tp: int, cp: int, seed: int = 1234) -> None:
    init_parallel(tp, cp, seed)


def _config(tp: int, cp: int, groups: int, **overrides):
    """A 2-layer GPT config: hidden 64, 4 heads of 16, ``groups`` key/value heads (4: no GQA)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=groups,
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **cpu_config_kwargs(),
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def _model(config, charm: bool, topology: str | None = None, spec=None, **kw):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from charm_megatron.megatron import use_charm

    spec = get_gpt_layer_local_spec() if spec is None else spec
    if charm:
        spec = use_charm(spec, topology=topology)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        **kw,
    )


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full ``[b, s]`` tokens and labels of training step ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(100 + step)
    data = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def _losses(model, step: int, reference: bool) -> torch.Tensor:
    """Per-token losses ``[b, s/cp]`` of this CP rank's part of batch ``step``."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    tokens, labels = _batch(step)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    # Megatron's own split (what pretrain_gpt.get_batch calls): chunks r and 2cp-1-r.
    batch = get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "positions": positions})
    tokens, labels, positions = batch["tokens"], batch["labels"], batch["positions"]
    # Megatron's DotProductAttention builds its default causal mask on "cuda": hand it one.
    # CHARM+ reads the mask type, not the tensor.
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None] if reference else None
    return model(tokens, positions, mask, labels=labels)


def _backward(losses: torch.Tensor, model) -> None:
    """Loss = mean over all tokens of the global batch; then Megatron's CP/DP grad all-reduce."""
    from megatron.core import parallel_state as ps

    (losses.sum() / (BATCH * SEQ)).backward()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    dp = ps.get_data_parallel_world_size()  # replicas here see identical data: average them
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= dp


def _global_loss(losses: torch.Tensor) -> float:
    from megatron.core import parallel_state as ps

    total = losses.detach().sum().reshape(1)
    dist.all_reduce(total, group=ps.get_context_parallel_group())
    return total.item() / (BATCH * SEQ)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(losses, ref_losses, grads, ref_grads) -> tuple[float, float]:
    """(max abs per-token loss difference, worst relative gradient norm difference)."""
    loss_err = (losses.detach() - ref_losses.detach()).abs().max().item()
    assert grads.keys() == ref_grads.keys()
    grad_err = max(
        ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
        for n in ref_grads
    )
    return loss_err, grad_err


def _reference(tp: int, groups: int, steps: int = 0, **overrides):
    """Stock megatron-core model at CP=1: state dict, step-0 losses [b, s] and grads, and the
    loss trajectory of ``steps`` SGD steps (``overrides``: config fields)."""
    _init_parallel(tp, 1)
    model = _model(_config(tp, 1, groups, **overrides), charm=False)
    # _extra_state entries (TE-compatible placeholders) are None, not tensors.
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    losses = _losses(model, 0, reference=True)
    _backward(losses, model)
    grads = _grads(model)
    trajectory = _train(model, steps, reference=True) if steps else []
    return state, losses.detach(), grads, trajectory


def _sgd(model) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _train(model, steps: int, reference: bool, opt=None) -> list[float]:
    """``steps`` SGD steps on batch 0 (so the loss visibly falls); the global mean loss
    before each step."""
    opt = opt or _sgd(model)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        losses = _losses(model, 0, reference)
        out.append(_global_loss(losses))
        _backward(losses, model)
        opt.step()
    return out


def _count_attention_calls() -> list[int]:
    """From now on, append to the returned list on every CharmDotProductAttention.forward call
    in this process (a rank calls this once)."""
    from charm_megatron.megatron import CharmDotProductAttention

    calls: list[int] = []
    forward = CharmDotProductAttention.forward

    def counting(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    CharmDotProductAttention.forward = counting
    return calls


# --------------------------------------------------------------------------- rank functions
def _rank_cp_matches_cp1(rank: int, world: int, layouts: tuple[tuple[int, int, str], ...],
                         algos: tuple[str, ...], group_options: tuple[int, ...],
                         overrides: dict | None = None) -> dict:
    """For each layout ``(tp, cp, topology)`` and number of key/value heads: the reference at
    TP=``tp``, CP=1, then each algo at CP=``cp`` (``overrides``: config fields of both).

    Returns {(tp, cp, groups, algo): (loss error, gradient error)}.
    """
    _cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    out = {}
    for tp, cp, topology in layouts:
        for groups in group_options:
            state, ref_losses, ref_grads, _ = _reference(tp, groups, **(overrides or {}))
            _init_parallel(tp, cp)
            ref_local = get_batch_on_this_cp_rank({"losses": ref_losses})["losses"]
            for algo in algos:
                model = _model(_config(tp, cp, groups, cp_comm_type=algo, **(overrides or {})),
                               charm=True, topology=topology)
                model.load_state_dict(state)
                losses = _losses(model, 0, reference=False)
                _backward(losses, model)
                out[(tp, cp, groups, algo)] = _compare(
                    losses, ref_local, _grads(model), ref_grads
                )
    ps.destroy_model_parallel()
    return out


def _rank_training(rank: int, world: int, cp: int, topology: str) -> dict:
    """Three SGD steps under charm vs CP=1; a ring checkpoint resumed under charm; recompute."""
    _cpu_megatron()
    from megatron.core import parallel_state as ps

    steps = 3
    state, _, _, ref_traj = _reference(1, groups=2, steps=steps)

    _init_parallel(1, cp)
    out: dict = {"reference": ref_traj}

    # Three steps with CHARM+, from the reference weights.
    model = _model(_config(1, cp, 2, cp_comm_type="charm"), charm=True, topology=topology)
    model.load_state_dict(state)
    calls = _count_attention_calls()
    out["charm"] = _train(model, steps, reference=False)
    out["charm_calls"] = len(calls)

    # Full and selective (core attention) recompute: the attention forward runs twice.
    for name, kw in (
        ("full_recompute", dict(recompute_granularity="full", recompute_method="uniform",
                                recompute_num_layers=1)),
        ("selective_recompute", dict(recompute_granularity="selective",
                                     recompute_modules=["core_attn"])),
    ):
        m = _model(_config(1, cp, 2, cp_comm_type="charm", **kw), charm=True, topology=topology)
        m.load_state_dict(state)
        calls.clear()
        out[name] = _train(m, steps, reference=False)
        out[name + "_calls"] = len(calls)

    # One step under ring, checkpoint (model + optimizer, through torch.save), resume under
    # charm; compare with ring carrying on.
    ring = _model(_config(1, cp, 2, cp_comm_type="ring"), charm=True, topology=topology)
    ring.load_state_dict(state)
    ring_opt = _sgd(ring)
    first = _train(ring, 1, reference=False, opt=ring_opt)
    buf = io.BytesIO()
    torch.save({"model": ring.state_dict(), "optimizer": ring_opt.state_dict()}, buf)
    rest_ring = _train(ring, steps - 1, reference=False, opt=ring_opt)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    charm = _model(_config(1, cp, 2, cp_comm_type="charm"), charm=True, topology=topology)
    charm.load_state_dict(ckpt["model"], strict=True)  # same keys: the attention has no state
    charm_opt = _sgd(charm)
    charm_opt.load_state_dict(ckpt["optimizer"])
    rest_charm = _train(charm, steps - 1, reference=False, opt=charm_opt)
    out["ring_then_ring"] = first + rest_ring
    out["ring_then_charm"] = first + rest_charm
    out["state_keys_equal"] = sorted(ring.state_dict()) == sorted(charm.state_dict())
    ps.destroy_model_parallel()
    return out


# --------------------------------------------------------------------------- tests
ALGOS = ("charm", "rmplus", "ring")


def _check_errors(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for (tp, cp, groups, algo), (loss_err, grad_err) in res.items():
            where = f"rank {rank} tp={tp} cp={cp} algo={algo} num_query_groups={groups}"
            assert loss_err <= LOSS_TOL, f"{where}: per-token loss differs by {loss_err:.3g}"
            assert grad_err <= GRAD_TOL, f"{where}: gradient relative error {grad_err:.3g}"


def test_cp4_topology_2x2_matches_cp1():
    """CP=4, topology 2x2, 4 and 2 key/value heads (GQA off / on), charm / rmplus / ring, and
    TransformerEngine's p2p / allgather (served by our ring / allgather plans on this machine
    without TE), vs the stock model at CP=1."""
    results = run_ranks(_rank_cp_matches_cp1, 4, ((1, 4, "2x2"),), (*ALGOS, "p2p", "allgather"),
                        (4, 2), timeout_s=300)
    _check_errors(results)


@pytest.mark.parametrize("softmax_type", ["learnable", "off-by-one"])
def test_cp4_softmax_offsets_match_cp1(softmax_type):
    """gpt-oss's learnable sinks and off-by-one softmax (megatron-core's softmax_type): CP=4,
    topology 2x2, GQA, charm / rmplus / ring vs the stock model at CP=1 (whose checkpoint,
    the learnable offset included, loads into ours unchanged); the offset's gradient is the
    sum of the CP ranks' shares after Megatron's gradient all-reduce."""
    results = run_ranks(_rank_cp_matches_cp1, 4, ((1, 4, "2x2"),), ALGOS, (2,),
                        {"softmax_type": softmax_type}, timeout_s=300)
    _check_errors(results)


def test_tp2_cp2_and_dp2_cp2_match_cp1():
    """On 4 ranks: TP=2 x CP=2 (topology 2x1: CHARM+ with one rank per group, cross-group
    queries only) and DP=2 x CP=2 (flat), with 2 and 1 key/value heads (1: MQA, fewer KV heads
    than TP ranks), vs the same TP at CP=1. Sequence parallelism is not testable here:
    megatron-core's torch norm refuses it without Apex / Transformer Engine."""
    layouts = ((2, 2, "2x1"), (1, 2, "flat"))
    results = run_ranks(_rank_cp_matches_cp1, 4, layouts, ALGOS, (2, 1), timeout_s=240)
    assert {k[:2] for k in results[0]} == {(2, 2), (1, 2)}
    _check_errors(results)


def test_training_trajectory_checkpoint_and_recompute():
    """3 SGD steps at CP=4 follow the CP=1 losses; a ring checkpoint continues under charm;
    full and selective recompute (attention forward run twice) give the same losses."""
    results = run_ranks(_rank_training, 4, 4, "2x2", timeout_s=240)
    for rank, res in enumerate(results):
        ref = res["reference"]
        for name in ("charm", "full_recompute", "selective_recompute", "ring_then_ring",
                     "ring_then_charm"):
            assert res[name] == pytest.approx(ref, rel=1e-5, abs=1e-6), (rank, name, res[name], ref)
        assert res["ring_then_charm"] == pytest.approx(res["ring_then_ring"], rel=1e-6), rank
        # 2 layers x 3 steps forward; recompute runs each attention forward once more.
        assert res["charm_calls"] == 6, res
        assert res["full_recompute_calls"] == res["selective_recompute_calls"] == 12, res
        assert res["state_keys_equal"], rank


# --------------------------------------------------------------------------- SP, bf16
class SequenceParallelNorm(torch.nn.LayerNorm):
    """A LayerNorm that allows sequence parallelism (test scaffolding).

    megatron-core's torch norm (``WrappedTorchNorm``) refuses ``sequence_parallel`` and its SP
    norms need Apex or TE; the math of a norm under SP is the same, only its parameters see a
    slice of the sequence, so their gradients are summed over the TP group (what Megatron's
    ``finalize_model_grads`` does for parameters marked ``sequence_parallel``)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for p in self.parameters():
            p.sequence_parallel = True


def _sp_spec():
    """The local GPT layer with SP-capable norms, as a 2-layer block spec (its final norm too)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = SequenceParallelNorm
    layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    return TransformerBlockSubmodules(layer_specs=[layer, layer], layer_norm=SequenceParallelNorm)


def _rank_sequence_parallel(rank: int, world: int, algos: tuple[str, ...]) -> dict:
    """TP=2 x CP=2 with --sequence-parallel vs TP=2, CP=1 without it."""
    _cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    state, ref_losses, ref_grads, _ = _reference(2, groups=2)
    _init_parallel(2, 2)
    ref_local = get_batch_on_this_cp_rank({"losses": ref_losses})["losses"]
    out = {}
    for algo in algos:
        config = _config(2, 2, 2, cp_comm_type=algo, sequence_parallel=True)
        model = _model(config, charm=True, topology="2x1", spec=_sp_spec())
        model.load_state_dict(state)
        losses = _losses(model, 0, reference=False)
        _backward(losses, model)
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False) and p.grad is not None:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
        out[algo] = _compare(losses, ref_local, _grads(model), ref_grads)
    ps.destroy_model_parallel()
    return out


def test_sequence_parallel_tp2_cp2_matches_cp1():
    results = run_ranks(_rank_sequence_parallel, 4, ("charm", "ring"), timeout_s=240)
    for rank, res in enumerate(results):
        assert set(res) == {"charm", "ring"}
        for algo, (loss_err, grad_err) in res.items():
            assert loss_err <= LOSS_TOL, (rank, algo, loss_err)
            assert grad_err <= GRAD_TOL, (rank, algo, grad_err)


def _rank_bf16(rank: int, world: int) -> dict:
    """bf16 parameters at CP=2 (DP=2) with CHARM+ and at CP=1 with Megatron's own attention,
    both against the fp32 model at CP=1."""
    _cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    state, ref_losses, ref_grads, _ = _reference(1, groups=2)  # fp32
    bf16 = dict(params_dtype=torch.bfloat16, bf16=True)

    def run(cp: int, charm: bool) -> tuple[float, float, str]:
        from megatron.core.transformer.module import Float16Module

        _init_parallel(1, cp)
        config = _config(1, cp, 2, cp_comm_type="charm", **bf16)
        inner = _model(config, charm=charm, topology="flat")
        inner.load_state_dict(state)
        # What Megatron-LM's --bf16 does: every parameter (norms too) in bf16, fp32 losses out.
        model = Float16Module(config, inner)
        dtypes = {p.dtype for p in model.parameters()}
        assert dtypes == {torch.bfloat16}, dtypes
        cores = [m for m in model.modules() if type(m).__name__ == "CharmDotProductAttention"]
        assert len(cores) == (2 if charm else 0)
        losses = _losses(model, 0, reference=not charm)
        _backward(losses, model)
        ref_local = get_batch_on_this_cp_rank({"losses": ref_losses})["losses"]
        grads = {n: g.float() for n, g in _grads(inner).items()}
        loss_err, grad_err = _compare(losses.float(), ref_local, grads, ref_grads)
        return loss_err, grad_err, str(losses.dtype)

    out = {"stock_cp1": run(1, charm=False), "charm_cp2": run(2, charm=True)}
    ps.destroy_model_parallel()
    return out


def test_bf16_parameters_at_model_level():
    """CHARM+ at CP=2 in bf16 is as close to the fp32 model as Megatron's own attention in
    bf16 at CP=1 (bf16 rounding dominates both)."""
    results = run_ranks(_rank_bf16, 4, timeout_s=240)
    for rank, res in enumerate(results):
        stock_loss, stock_grad, _ = res["stock_cp1"]
        loss_err, grad_err, _ = res["charm_cp2"]
        assert 0 < stock_loss < 0.5 and 0 < stock_grad < 0.5, res  # bf16 differs from fp32
        assert loss_err <= 1.5 * stock_loss + 1e-2, (rank, res)
        assert grad_err <= 1.5 * stock_grad + 1e-2, (rank, res)


# --------------------------------------------------------------------------- MLA
def _mla_config(cp: int, comm: str | None = None):
    """A 2-layer DeepSeek-style MLA config: 4 heads, q / k head dim 24 (16 + 8 of RoPE),
    v head dim 16, low-rank q and kv projections."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    kw = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
              q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
              v_head_dim=16, rope_type="rope", multi_latent_attention=True,
              context_parallel_size=cp, hidden_dropout=0.0, attention_dropout=0.0,
              **cpu_config_kwargs())
    if comm is not None:
        kw["cp_comm_type"] = comm
    return MLATransformerConfig(**kw)


def _rank_mla(rank: int, world: int, algos: tuple[str, ...]) -> dict:
    """MLA at CP=1 (our layer at CP 1 is plain local attention; megatron-core's local core
    attention takes no MLA head dims, so it cannot be the reference) then each algo at CP=4
    (2x2) from the same weights: {algo: (loss error, gradient error)}."""
    _cpu_megatron()
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.utils import get_batch_on_this_cp_rank

    # megatron-core 0.16.1 sets HAVE_TE when its TE extension module imports, which it does
    # without TE (TELinear is then a mock, not a class), then calls isinstance(.., TELinear).
    if not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    _init_parallel(1, 1)
    ref = _model(_mla_config(1), charm=True, spec=spec)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state_dict().items()}
    ref_losses = _losses(ref, 0, reference=False)
    _backward(ref_losses, ref)
    ref_grads = _grads(ref)
    core = ref.decoder.layers[0].self_attention.core_attention
    out = {"core": (type(core).__name__, core.k_channels, core.v_channels)}
    _init_parallel(1, 4)
    ref_local = get_batch_on_this_cp_rank({"losses": ref_losses.detach()})["losses"]
    for algo in algos:
        model = _model(_mla_config(4, algo), charm=True, topology="2x2", spec=spec)
        model.load_state_dict(state)
        losses = _losses(model, 0, reference=False)
        _backward(losses, model)
        out[algo] = _compare(losses, ref_local, _grads(model), ref_grads)
    ps.destroy_model_parallel()
    return out


def test_cp4_multi_latent_attention_matches_cp1():
    """DeepSeek-style MLA (q / k head dim 24, v 16: the value head dim differs) through
    megatron-core's MLASelfAttention on the local spec with use_charm: CP=4 (2x2) matches CP=1,
    loss and every gradient, for charm, rmplus and ring."""
    results = run_ranks(_rank_mla, 4, ALGOS, timeout_s=300)
    for rank, res in enumerate(results):
        assert res["core"] == ("CharmDotProductAttention", 24, 16), res["core"]
        for algo in ALGOS:
            loss_err, grad_err = res[algo]
            assert loss_err <= LOSS_TOL, (rank, algo, loss_err)
            assert grad_err <= GRAD_TOL, (rank, algo, grad_err)


# --------------------------------------------------------------------------- sliding windows
def _rank_windowed(rank: int, world: int, algos: tuple[str, ...], overrides: dict) -> dict:
    """:func:`_rank_cp_matches_cp1` with megatron-core's sliding-window mask built on the CPU
    (0.16.1's ``get_sliding_window_causal_mask`` allocates on ``device="cuda"`` literally)."""
    import megatron.core.fusions.fused_softmax as fused_softmax

    def window_mask(sq, skv, window_size):  # noqa: ANN001, ANN202 - the same mask, on CPU
        m = torch.ones(sq, skv, dtype=torch.bool)
        m = torch.triu(m, diagonal=skv - sq - window_size[0])
        return ~torch.tril(m, diagonal=skv - sq + window_size[1])

    fused_softmax.get_sliding_window_causal_mask = window_mask
    return _rank_cp_matches_cp1(rank, world, ((1, 4, "2x2"),), algos, (2,), overrides)


def test_cp4_alternating_window_and_full_layers_match_cp1():
    """Gemma 3 / gpt-oss style: a causal sliding window (5 tokens back, shorter than a CP
    chunk's span) on layer 1 and full attention on layer 2 (window_attn_skip_freq=2), GQA,
    CP=4 (2x2), charm / rmplus / ring vs megatron-core's own attention at CP=1."""
    results = run_ranks(_rank_windowed, 4, ALGOS,
                        {"window_size": (5, 0), "window_attn_skip_freq": 2}, timeout_s=300)
    _check_errors(results)
