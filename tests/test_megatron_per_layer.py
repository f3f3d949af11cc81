"""Per-layer ``--cp-comm-type`` inside real megatron-core models on gloo CPU ranks.

* CP=4, four layers mixing our algorithms (``charm ring rmplus charm``) match the stock model
  at CP=1 (per-token loss and every gradient), and each layer runs its own entry (L-1).
* Megatron's own values keep the spec's core attention: a model mixing ``charm`` with
  ``a2a`` / ``p2p`` / ``a2a+p2p`` builds CHARM+ where the entry is ours and the spec's module
  elsewhere, with the value passed through unchanged. Transformer Engine is not installable
  here, so the spec's TE slot holds a recording stand-in: the test checks which module each
  layer builds and with what, not TE's numerics.
* Pipeline parallelism 2 x CP 2 (4 ranks): megatron-core's pipeline schedules allocate CUDA
  tensors (``schedules.py`` builds its token counters on ``"cuda"``), so the two stages are
  driven by hand: stage 0 runs its layers and sends the activations to stage 1 (``dist.send``
  on the pipeline group), stage 1 computes the loss, and the activation gradient goes back.
  Every stage's CHARM+ layers must sit on that stage's CP group, carry the global layer
  number (stage offset included) and its list entry, and losses / gradients must match CP=1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from charm_megatron.local_ranks import run_ranks

pytest.importorskip("megatron.core")

from test_megatron_model import (  # noqa: E402
    BATCH,
    GRAD_TOL,
    LOSS_TOL,
    SEQ,
    _backward,
    _compare,
    _config,
    _cpu_megatron,
    _grads,
    _init_parallel,
    _losses,
    _model,
)

MIXED = ["charm", "ring", "rmplus", "charm"]


def _cores(model) -> list:
    return [layer.self_attention.core_attention for layer in model.decoder.layers]


def _reference_4_layers():
    """Stock megatron-core model, 4 layers, CP=1: state, per-token losses [b, s], grads."""
    _init_parallel(1, 1)
    model = _model(_config(1, 1, 2, num_layers=4), charm=False,
                   share_embeddings_and_output_weights=False)
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}
    losses = _losses(model, 0, reference=True)
    _backward(losses, model)
    return state, losses.detach(), _grads(model)


class RecordingAttention(torch.nn.Module):
    """Stands in for the spec's own core attention (TE's, in a TE spec): records how it was
    built. Never run."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
        super().__init__()
        self.layer_number = layer_number
        self.kwargs = kwargs


def _rank_mixed_cp4(rank: int, world: int) -> dict:
    _cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.utils import get_batch_on_this_cp_rank

    from charm_megatron.megatron import PerLayerCommTypes

    out: dict = {}
    state, ref_losses, ref_grads = _reference_4_layers()

    _init_parallel(1, 4)
    ref_local = get_batch_on_this_cp_rank({"losses": ref_losses})["losses"]
    model = _model(_config(1, 4, 2, num_layers=4, cp_comm_type=PerLayerCommTypes(MIXED)),
                   charm=True, topology="2x2", share_embeddings_and_output_weights=False)
    model.load_state_dict(state)
    out["algos"] = [c.algo for c in _cores(model)]
    out["layers"] = [c.layer_number for c in _cores(model)]
    losses = _losses(model, 0, reference=False)
    _backward(losses, model)
    out["errors"] = _compare(losses, ref_local, _grads(model), ref_grads)

    # megatron-core 0.16.1 with a plain list: its TransformerLayer reads entry layer_number
    # (1-based), so the last layer falls off the end before any core attention is built.
    try:
        _model(_config(1, 4, 2, num_layers=4, cp_comm_type=list(MIXED)), charm=True,
               topology="2x2")
        out["plain_list"] = "ok"
    except IndexError as exc:
        out["plain_list"] = f"IndexError: {exc}"

    # Megatron's own values keep the spec's core attention, value unchanged.
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = RecordingAttention
    values = ["charm", "a2a", "p2p", "a2a+p2p"]
    mixed = _model(_config(1, 4, 2, num_layers=4, cp_comm_type=PerLayerCommTypes(values)),
                   charm=True, topology="2x2", spec=spec)
    out["te_classes"] = [type(c).__name__ for c in _cores(mixed)]
    out["te_values"] = [
        c.algo if hasattr(c, "algo") else c.kwargs.get("cp_comm_type") for c in _cores(mixed)
    ]
    ps.destroy_model_parallel()
    return out


def test_cp4_per_layer_algorithms_match_cp1_and_megatron_values_keep_their_attention():
    results = run_ranks(_rank_mixed_cp4, 4, timeout_s=300)
    import megatron.core

    for rank, res in enumerate(results):
        assert res["algos"] == MIXED, (rank, res["algos"])
        assert res["layers"] == [1, 2, 3, 4]
        loss_err, grad_err = res["errors"]
        assert loss_err <= LOSS_TOL, (rank, loss_err)
        assert grad_err <= GRAD_TOL, (rank, grad_err)
        assert res["te_classes"] == ["CharmDotProductAttention"] + ["RecordingAttention"] * 3
        assert res["te_values"] == ["charm", "a2a", "p2p", "a2a+p2p"]
        if megatron.core.__version__.startswith("0.16."):
            assert res["plain_list"].startswith("IndexError"), res["plain_list"]


# --------------------------------------------------------------------------- PP 2 x CP 2
def _stage_key(key: str, offset: int) -> str:
    """A stage's state-dict key -> the full model's (its layers are numbered from 0)."""
    prefix = "decoder.layers."
    if key.startswith(prefix):
        index, rest = key[len(prefix):].split(".", 1)
        return f"{prefix}{int(index) + offset}.{rest}"
    return key


def _rank_pp2_cp2(rank: int, world: int) -> dict:
    _cpu_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import get_batch_on_this_cp_rank

    from charm_megatron.megatron import PerLayerCommTypes

    state, ref_losses, ref_grads = _reference_4_layers()

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, context_parallel_size=2)
    mrandom.model_parallel_cuda_manual_seed(1234, force_reset_rng=True)
    stage = ps.get_pipeline_model_parallel_rank()
    first, last = stage == 0, stage == 1
    config = _config(1, 2, 2, num_layers=4, pipeline_model_parallel_size=2,
                     pipeline_dtype=torch.float32, cp_comm_type=PerLayerCommTypes(MIXED))
    model = _model(config, charm=True, topology="2x1", pre_process=first, post_process=last,
                   share_embeddings_and_output_weights=False)
    offset = 2 * stage
    mine = {k: state[_stage_key(k, offset)] for k in model.state_dict()}
    model.load_state_dict(mine)

    out: dict = {
        "stage": stage,
        "cp_ranks": sorted(ps.get_context_parallel_global_ranks()),
        "layers": [c.layer_number for c in _cores(model)],
        "algos": [c.algo for c in _cores(model)],
        "core_cp_ranks": [
            sorted(dist.get_process_group_ranks(c.cp_group)) for c in _cores(model)
        ],
    }

    # Stage 0 -> stage 1 by hand (see the module docstring).
    pp_group = ps.get_pipeline_model_parallel_group()
    shape = (SEQ // 2, BATCH, 64)  # [s/cp, b, hidden]
    if first:
        hidden = _losses(model, 0, reference=False)  # no post_process: the hidden states
        assert tuple(hidden.shape) == shape, hidden.shape
        dist.send(hidden.detach().contiguous(), ps.get_pipeline_model_parallel_next_rank(),
                  group=pp_group)
        grad = torch.empty(shape)
        dist.recv(grad, ps.get_pipeline_model_parallel_prev_rank(), group=pp_group)
        hidden.backward(grad)
    else:
        received = torch.empty(shape)
        dist.recv(received, ps.get_pipeline_model_parallel_prev_rank(), group=pp_group)
        received.requires_grad_(True)
        model.set_input_tensor(received)
        losses = _losses(model, 0, reference=False)
        (losses.sum() / (BATCH * SEQ)).backward()
        dist.send(received.grad.contiguous(), ps.get_pipeline_model_parallel_next_rank(),
                  group=pp_group)
        ref_local = get_batch_on_this_cp_rank({"losses": ref_losses})["losses"]
        out["loss_err"] = (losses.detach() - ref_local).abs().max().item()
    # Megatron's finalize_model_grads: all-reduce over the stage's DP x CP group.
    group = ps.get_data_parallel_group(with_context_parallel=True)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
    grads = {_stage_key(k, offset): v for k, v in _grads(model).items()}
    out["grad_keys"] = sorted(grads)
    out["grad_err"] = max(
        ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)).item()
        for n in grads
    )
    ps.destroy_model_parallel()
    return out


def test_pp2_cp2_stages_use_their_cp_group_and_match_cp1():
    results = run_ranks(_rank_pp2_cp2, 4, timeout_s=300)
    for rank, res in enumerate(results):
        stage = rank // 2  # megatron's order tp-cp-ep-dp-pp: ranks 0,1 stage 0; 2,3 stage 1
        assert res["stage"] == stage, res
        assert res["cp_ranks"] == [2 * stage, 2 * stage + 1], res
        assert res["core_cp_ranks"] == [res["cp_ranks"]] * 2, res
        assert res["layers"] == [2 * stage + 1, 2 * stage + 2], res  # stage offset included
        assert res["algos"] == MIXED[2 * stage: 2 * stage + 2], res
        assert res["grad_err"] <= GRAD_TOL, (rank, res["grad_err"])
        if stage == 1:
            assert res["loss_err"] <= LOSS_TOL, (rank, res["loss_err"])
    # Every parameter of the full model got a gradient on exactly one stage.
    stage0, stage1 = set(results[0]["grad_keys"]), set(results[2]["grad_keys"])
    assert not stage0 & stage1 and len(stage0 | stage1) > 0
