"""Run megatron-core 0.16 pieces on a CPU-only torch (gloo ranks, one process per rank).

megatron-core assumes CUDA in a few places that a CPU training step reaches. :func:`patch_for_cpu`
redirects exactly those, once per process; everything else (``GPTModel``, its layers, RoPE,
``parallel_state``, ``get_batch_on_this_cp_rank``, the mock dataset, the LR scheduler) runs as
shipped. The same redirections live in ``tests/test_megatron_model.py`` (``_cpu_megatron``),
which predates this module.

What is redirected, and why:

* ``torch.cuda.current_device`` -> ``"cpu"``: RoPE moves ``inv_freq`` to the current device on
  its first forward (``rotary_pos_embedding.py``, ``get_emb``), and megatron's
  ``GlobalMemoryBuffer`` allocates there.
* RoPE's per-CP-rank slice (``rope_utils.get_pos_emb_on_this_cp_rank``) builds its index with
  ``pin_memory=True`` and ``.cuda()``; the same slice is :func:`charm_megatron.layout.shard`.
* The tensor-parallel RNG tracker (``model_parallel_cuda_manual_seed``) reads and writes the CUDA
  generator; here it uses the CPU generator.

Not usable on CPU (they create tensors with ``device="cuda"`` literally, which no patch of
``current_device`` reaches): the pipeline schedules' token counter, ``clip_grad_norm_fp32``,
``MegatronOptimizer``'s scalars. :mod:`charm_megatron.train_demo.train` mirrors those steps
with plain torch and says where.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from charm_megatron.layout import shard

__all__ = ["cpu_config_kwargs", "init_parallel", "patch_for_cpu", "quiet_megatron"]

_PATCHED = False


def patch_for_cpu() -> None:
    """Make megatron-core 0.16.1 run on a CPU-only torch (idempotent; call in every rank)."""
    global _PATCHED
    if _PATCHED:
        return
    import megatron.core.models.common.embeddings.rotary_pos_embedding as rope
    import torch
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):  # noqa: ANN001, ANN202
        return shard(pos_emb, cp_group.rank(), cp_group.size(), seq_dim=seq_dim)

    rope.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = torch.manual_seed  # type: ignore[assignment]
    _PATCHED = True


def cpu_config_kwargs() -> dict[str, Any]:
    """``TransformerConfig`` settings a CPU run needs: fp32 parameters built on the CPU, and
    every fused kernel off (they are CUDA-only)."""
    import torch

    return dict(
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=False,
    )


def quiet_megatron() -> None:
    """Silence megatron-core's start-up chatter on CPU (no Apex / TE warnings, INFO logs)."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def init_parallel(tp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """``parallel_state.initialize_model_parallel`` plus megatron's model-parallel seeding.

    Re-initialises when called again (e.g. between two models in one process).
    """
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    patch_for_cpu()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    mrandom.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    torch.manual_seed(seed)
