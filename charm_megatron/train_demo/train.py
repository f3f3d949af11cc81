"""The training job of ``charm-megatron demo``, one call per rank: megatron-core's GPTModel with
context parallelism on CPU ranks (gloo), trained once per CP comm type.

Per rank, :func:`train_rank`:

1. ``parallel_state.initialize_model_parallel(context_parallel_size=CP)`` and megatron's seeding;
2. megatron-core's mock data: ``MockGPTDataset`` built by ``BlendedMegatronDatasetBuilder`` from a
   ``GPTDatasetConfig`` with megatron-core's ``NullTokenizer`` (no files, no downloads);
3. for each comm type (``ring``, ``charm``): a ``GPTModel`` from the local layer spec passed
   through :func:`charm_megatron.megatron.use_charm`, built from the same seed (identical
   weights), wrapped in megatron-core's ``DistributedDataParallel``; ``torch.optim.AdamW`` with
   Megatron's parameter groups (the class megatron-core itself falls back to without Apex / TE),
   and megatron-core's ``OptimizerParamScheduler``;
4. iterations, the comm types taking turns (so machine noise, e.g. other jobs, hits both alike).

One training iteration does what Megatron-LM's ``train_step`` does for TP = PP = 1:
``get_batch`` (megatron-core's ``get_batch_on_this_cp_rank`` split), forward with labels, the loss
of ``pretrain_gpt.loss_func`` scaled as ``schedules.forward_step_calc_loss`` does, backward,
megatron-core's ``finalize_model_grads`` (the gradient all-reduce over the data-parallel x
context-parallel group), gradient clipping, the optimizer and scheduler steps, and the reported
``lm loss`` (token mean over the DP x CP group). Megatron's own schedule, optimizer wrapper and
``clip_grad_norm_fp32`` create tensors on ``"cuda"`` literally, so those three are mirrored here
with plain torch (same arithmetic; the clipping norm is the local one, which equals the global
norm because every CP rank holds the all-reduced gradient of every parameter).
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from charm_megatron.train_demo.cpu_megatron import cpu_config_kwargs, init_parallel, quiet_megatron
from charm_megatron.train_demo.megatron_log import (
    IterationRecord,
    argument_dump,
    format_iteration,
    padded_vocab_size,
)

__all__ = ["TrainSpec", "train_rank"]


@dataclass(frozen=True)
class TrainSpec:
    """Everything a rank needs (picklable): the config's resolved values, what to train, where
    to write the logs."""

    config_name: str
    run_name: str
    values: dict[str, Any]
    comm_types: tuple[str, ...]
    log_paths: dict[str, str]
    topology: str | None
    #: Iterations the progress bar marks as warm-up (left out of the timing comparison).
    warmup_iters: int = 0
    barrier_timeout_s: float = 120.0
    progress: bool = True


# --------------------------------------------------------------------------- building blocks
def _transformer_config(v: dict[str, Any], comm: str) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=v["num_layers"],
        hidden_size=v["hidden_size"],
        ffn_hidden_size=v["ffn_hidden_size"] or 4 * v["hidden_size"],
        num_attention_heads=v["num_attention_heads"],
        num_query_groups=v["num_query_groups"],
        tensor_model_parallel_size=v["tensor_model_parallel_size"],
        pipeline_model_parallel_size=v["pipeline_model_parallel_size"],
        context_parallel_size=v["context_parallel_size"],
        cp_comm_type=comm,
        normalization=v["normalization"],
        gated_linear_unit=bool(v["swiglu"]),
        add_bias_linear=not v["disable_bias_linear"],
        init_method_std=v["init_method_std"],
        hidden_dropout=v["hidden_dropout"],
        attention_dropout=v["attention_dropout"],
        # fp32 on the CPU, fused kernels off (the config's fused_kernels: false).
        **cpu_config_kwargs(),
    )


def _build_model(v: dict[str, Any], comm: str, vocab: int) -> Any:
    """GPTModel with CHARM+'s core attention (``comm`` picks ring / rmplus / charm inside it),
    wrapped in megatron-core's DDP; built from the config's seed so every comm type starts from
    the same weights."""
    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom

    from charm_megatron.megatron import use_charm

    mrandom.model_parallel_cuda_manual_seed(v["seed"], force_reset_rng=True)
    torch.manual_seed(v["seed"])
    config = _transformer_config(v, comm)
    if v["swiglu"]:
        config.activation_func = F.silu
    model = GPTModel(
        config=config,
        transformer_layer_spec=use_charm(get_gpt_layer_local_spec(
            normalization=v["normalization"])),
        vocab_size=vocab,
        max_sequence_length=v["max_position_embeddings"] or v["seq_length"],
        position_embedding_type=v["position_embedding_type"],
        rotary_base=v["rotary_base"] or 10000,
        share_embeddings_and_output_weights=not v["untie_embeddings_and_output_weights"],
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp_config, model)


def _optimizer(model: Any, v: dict[str, Any]) -> tuple[Any, Any]:
    """AdamW with Megatron's default groups (no weight decay on biases and 1-D parameters) and
    megatron-core's ``OptimizerParamScheduler`` stepped in samples, as Megatron-LM does."""
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if name.endswith(".bias") or p.ndim == 1 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
        lr=v["lr"], betas=(v["adam_beta1"], v["adam_beta2"]), eps=v["adam_eps"],
        weight_decay=v["weight_decay"])
    gbs = v["global_batch_size"]
    iters = v["train_iters"]
    warmup = v["lr_warmup_iters"] or 0
    if v.get("lr_warmup_fraction"):
        warmup = int(v["lr_warmup_fraction"] * (v["lr_decay_iters"] or iters))
    decay_iters = v["lr_decay_iters"] or iters
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=v["lr"], min_lr=v["min_lr"] or 0.0,
        lr_warmup_steps=warmup * gbs, lr_decay_steps=decay_iters * gbs,
        lr_decay_style=v["lr_decay_style"], start_wd=v["weight_decay"],
        end_wd=v["weight_decay"], wd_incr_steps=iters * gbs, wd_incr_style="constant")
    return opt, sched


def _tokenizer_and_data(v: dict[str, Any], num_samples: int) -> tuple[Any, Any]:
    """megatron-core's NullTokenizer and MockGPTDataset (what ``--mock-data --tokenizer-type
    NullTokenizer`` gives Megatron-LM)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers import MegatronTokenizer

    if v["tokenizer_type"] != "NullTokenizer" or not v["mock_data"]:
        raise ValueError("the CPU demo needs mock_data: true and tokenizer_type: NullTokenizer")
    tokenizer = MegatronTokenizer.from_pretrained(metadata_path={"library": "null"},
                                                  vocab_size=v["vocab_size"])
    config = GPTDatasetConfig(
        random_seed=v["seed"], sequence_length=v["seq_length"], blend=None,
        split=v["split"], reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=tokenizer, create_attention_mask=False,
        path_to_cache=None, mid_level_dataset_surplus=0.005)
    train, _, _ = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [num_samples, None, None], lambda: True, config).build()
    return tokenizer, train


def _batches(dataset: Any, micro_batch_size: int, dp_rank: int, dp_size: int) -> Iterator[dict]:
    """Micro-batches in the order of Megatron-LM's ``MegatronPretrainingSampler``: consecutive
    samples, each data-parallel rank taking its slice of every ``micro_batch x DP`` block."""
    import torch

    start = 0
    while True:
        block = range(start, start + micro_batch_size * dp_size)
        mine = list(block)[dp_rank * micro_batch_size:(dp_rank + 1) * micro_batch_size]
        samples = [dataset[i] for i in mine]
        yield {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in samples[0]}
        start += micro_batch_size * dp_size


@dataclass
class _Job:
    """One comm type's model, optimizer and log inside a rank."""

    comm: str
    model: Any
    optimizer: Any
    scheduler: Any
    data: Iterator[dict]
    log: Any = None
    records: list[dict] = field(default_factory=list)
    consumed: int = 0


def _train_step(job: _Job, v: dict[str, Any], num_microbatches: int) -> tuple[float, float]:
    """One Megatron-LM training iteration; returns (lm loss, grad norm)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_batch_on_this_cp_rank

    model = job.model
    model.zero_grad_buffer()
    job.optimizer.zero_grad(set_to_none=True)
    reported = torch.zeros(2, dtype=torch.float64)
    for _ in range(num_microbatches):
        # pretrain_gpt.get_batch: the batch, then Megatron's load-balanced CP split.
        batch = get_batch_on_this_cp_rank(next(job.data))
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        # pretrain_gpt.loss_func: sum of masked per-token losses and the token count ...
        mask = batch["loss_mask"].float()
        loss = torch.sum(losses.float().view(-1) * mask.view(-1))
        tokens = mask.sum()
        reported += torch.stack([loss.detach(), tokens]).double()
        # ... and schedules.forward_step_calc_loss: divide by the local token count and the
        # number of micro-batches; DDP then averages over the DP x CP group.
        (loss / torch.clamp(tokens, min=1) / num_microbatches).backward()
    finalize_model_grads([model])  # the DP x CP gradient all-reduce (megatron-core)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        # MegatronOptimizer.prepare_grads: the optimizer reads DDP's main_grad.
        p.grad = p.main_grad
    grad_norm = torch.nn.utils.clip_grad_norm_(params, v["clip_grad"] or float("inf"))
    job.optimizer.step()
    gbs = v["global_batch_size"]
    job.scheduler.step(increment=gbs)
    job.consumed += gbs
    # training.train_step: the reported lm loss is the token mean over the DP x CP group.
    dist.all_reduce(reported, group=ps.get_data_parallel_group(with_context_parallel=True))
    return (reported[0] / reported[1].clamp(min=1)).item(), float(grad_norm)


def _timed_barrier(timeout_s: float) -> None:
    """A world barrier that fails instead of hanging when a rank is stuck."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    else:
        dist.barrier()


def _progress(done: int, total: int, last: dict[str, float], warmup: int) -> str:
    width = 24
    fill = round(width * done / total)
    times = "  ".join(f"{c} {ms:7.0f} ms" for c, ms in last.items())
    tag = " (warm-up)" if done <= warmup else ""
    return f"  [{'#' * fill}{'.' * (width - fill)}] iteration {done:3d}/{total}  {times}{tag}"


def train_rank(rank: int, world: int, spec: TrainSpec) -> dict[str, list[dict]]:
    """Train one model per comm type on this rank (see the module docstring); global rank 0
    writes the Megatron-LM logs and prints the progress bar. Returns per comm type the
    iteration records (every rank returns the same values)."""
    quiet_megatron()
    from megatron.core import parallel_state as ps

    from charm_megatron.megatron import set_topology

    v = dict(spec.values)
    tp, cp = v["tensor_model_parallel_size"], v["context_parallel_size"]
    if v["pipeline_model_parallel_size"] != 1:
        raise ValueError("the CPU demo runs pipeline_model_parallel_size 1")
    init_parallel(tp=tp, cp=cp, seed=v["seed"])
    set_topology(spec.topology)
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    mbs, gbs, iters = v["micro_batch_size"], v["global_batch_size"], v["train_iters"]
    if gbs % (mbs * dp):
        raise ValueError(f"global_batch_size {gbs} is not a multiple of micro_batch_size x DP "
                         f"= {mbs * dp}")
    num_microbatches = gbs // (mbs * dp)

    tokenizer, dataset = _tokenizer_and_data(v, iters * gbs)
    vocab = padded_vocab_size(tokenizer.vocab_size, 128, tp)

    jobs = []
    for comm in spec.comm_types:
        model = _build_model(v, comm, vocab)
        opt, sched = _optimizer(model, v)
        jobs.append(_Job(comm, model, opt, sched, _batches(dataset, mbs, dp_rank, dp)))
    if rank == 0:
        for job in jobs:
            path = spec.log_paths[job.comm]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            job.log = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed below
            args = dict(v, cp_comm_type=[job.comm], charm_topology=spec.topology, world_size=world,
                        data_parallel_size=dp, padded_vocab_size=vocab)
            job.log.write(argument_dump(args) + "\n")
            job.log.write(f"charm-megatron demo: {spec.config_name} run {spec.run_name}, "
                          f"--cp-comm-type {job.comm}, {world} CPU ranks (gloo)\n")
            job.log.flush()

    tty = sys.stdout.isatty()
    try:
        for it in range(1, iters + 1):
            # Alternate who goes first, so neither comm type always follows the other's traffic.
            order = jobs if it % 2 else list(reversed(jobs))
            last: dict[str, float] = {}
            for job in order:
                _timed_barrier(spec.barrier_timeout_s)
                t0 = time.perf_counter()
                loss, norm = _train_step(job, v, num_microbatches)
                # Megatron's interval timer stops with a barrier: the slowest rank's time.
                _timed_barrier(spec.barrier_timeout_s)
                elapsed = time.perf_counter() - t0
                rec = IterationRecord(
                    iteration=it, train_iters=iters, consumed_samples=job.consumed,
                    elapsed_ms=elapsed * 1e3,
                    learning_rate=job.optimizer.param_groups[0]["lr"],
                    global_batch_size=gbs, lm_loss=loss, grad_norm=norm)
                if job.log is not None:
                    job.log.write(format_iteration(rec) + "\n")
                    job.log.flush()
                job.records.append(asdict(rec))
                last[job.comm] = elapsed * 1e3
            if rank == 0 and spec.progress:
                line = _progress(it, iters, {j.comm: last[j.comm] for j in jobs},
                                 spec.warmup_iters)
                print(("\r" + line) if tty else line, end="" if tty and it < iters else "\n",
                      flush=True)
    finally:
        for job in jobs:
            if job.log is not None:
                job.log.close()
    _timed_barrier(spec.barrier_timeout_s)
    ps.destroy_model_parallel()
    return {job.comm: job.records for job in jobs}


def summarize(records: dict[str, list[dict]], skip: int) -> dict[str, Any]:
    """Median iteration time per comm type (after ``skip`` warm-up iterations) and the largest
    loss difference between comm types (absolute and relative to the first's loss)."""
    import statistics

    out: dict[str, Any] = {"median_ms": {}}
    for comm, recs in records.items():
        kept = [r["elapsed_ms"] for r in recs[skip:]] or [r["elapsed_ms"] for r in recs]
        out["median_ms"][comm] = statistics.median(kept)
    comms: Sequence[str] = list(records)
    base = records[comms[0]]
    abs_diff, rel_diff = 0.0, 0.0
    for other in comms[1:]:
        for a, b in zip(base, records[other]):
            d = abs(a["lm_loss"] - b["lm_loss"])
            abs_diff = max(abs_diff, d)
            rel_diff = max(rel_diff, d / max(abs(a["lm_loss"]), 1e-30))
    out["loss_abs_diff"], out["loss_rel_diff"] = abs_diff, rel_diff
    return out
