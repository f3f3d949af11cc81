"""What the benchmark times: one callable per algorithm, all on Megatron's ``[s, b, h, d]``.

* ``ring``, ``rmplus``, ``charm``: :func:`charm_megatron.cp_attention` with that ``algo``.
* ``auto``: ``cp_attention(algo="auto")``, the performance model's pick for the point
  (:class:`AutoContender`; the pick is reported beside its times).
* ``torch``: PyTorch's own context-parallel ring attention
  (``torch.distributed.tensor.experimental``). Two ways to run it:

  - ``api``: the public ``context_parallel(mesh)`` context, which patches
    ``F.scaled_dot_product_attention`` and routes the CUDA flash / efficient / cuDNN kernels
    through ``_templated_ring_attention``. In torch 2.13 this does **not** run on CPU: the CPU
    kernel (``aten._scaled_dot_product_flash_attention_for_cpu``) has no DTensor sharding
    strategy, so the call raises ``NotImplementedError`` (measured; the probe below records the
    exact message).
  - ``core``: the same ring loop (``_templated_ring_attention`` and its backward, private
    functions of ``torch.distributed.tensor.experimental._context_parallel._attention``) called
    directly with the CPU kernel as its block op. Same communication (``alltoall`` rotation:
    one ``permute_tensor`` per step; or ``allgather``), same merge, same load-balanced causal
    halves; only the DTensor dispatch is skipped. Used on CPU.

  Both need the causal layout to be the head-tail one (chunks ``r`` and ``2n-1-r``), which is
  exactly Megatron's, so every contender gets identical inputs.

Each contender has ``session()``: a context entered around one forward *and* its backward
(the public torch API needs its patch active while autograd runs the backward).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from charm_megatron.lab.bench import links
from charm_megatron.lab.bench.config import BenchConfig, Point
from charm_megatron.ops.attention import cp_attention, resolve_algo
from charm_megatron.ops.options import CPOptions
from charm_megatron.plan.registry import uses_topology

aten = torch.ops.aten
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Contender:
    """One timed algorithm: ``__call__(q, k, v) -> out`` (sbhd, differentiable)."""

    name: str = ""
    ablatable: bool = False  # has ablated variants (ablated())

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def ablated(self, ablation: str) -> Contender:
        """This contender with ``ablation`` (``none``, ``compute_only`` or ``comm_only``,
        :class:`~charm_megatron.ops.options.CPOptions`); only ``ablatable`` ones have them."""
        if ablation == "none":
            return self
        raise NotImplementedError(f"bench: contender {self.name!r} has no ablated runs "
                                  f"({ablation}); only this package's plans do")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        yield


class PlanContender(Contender):
    """``cp_attention(..., algo=name)``: the plans of this package."""

    ablatable = True

    def __init__(self, algo: str, topology: str | None, causal: bool,
                 packed: dict | None = None, options: CPOptions | None = None,
                 roles: str = "bytes", settings: tuple[tuple[str, str], ...] = (),
                 backend=None, window: tuple[int, int] | None = None,
                 partials: str | None = None, auto_tune: str | None = None) -> None:
        self.name = algo
        self._args = (algo, topology, causal, packed)
        self.window = window
        self.roles = roles
        # The bench's CHARM_* settings (the job's environment, set before the line-up) and its
        # --setting values over them, read once here; ablated variants differ only in
        # options.ablation. backend: an emulated GPU cluster's timed device (else the kernels).
        extra_opts: dict = {"backend": backend} if backend is not None else {}
        if partials is not None:  # --partials, over CHARM_PARTIALS
            extra_opts["partials"] = partials
        if auto_tune is not None:  # --auto-tune, over CHARM_AUTO_TUNE
            extra_opts["auto_tune"] = auto_tune
        self.options = (options if options is not None
                        else CPOptions.from_env(**dict(settings), **extra_opts))
        # packed: cu_seqlens / cu_seqlens_padded for THD inputs (the benchmark's packed mode).
        # roles: the role mix, for packed and unpacked calls alike.
        extra = {**(packed or {}), "roles": roles, "window_size": window}
        self._fn = functools.partial(cp_attention, algo=algo, causal=causal,
                                     topology=topology if uses_topology(algo) else None,
                                     options=self.options, **extra)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self._fn(q, k, v)

    def ablated(self, ablation: str) -> PlanContender:
        if ablation == self.options.ablation:
            return self
        return PlanContender(*self._args, options=self.options.with_(ablation=ablation),
                             roles=self.roles, window=self.window)


class AutoContender(PlanContender):
    """``cp_attention(..., algo="auto")``: the performance model's pick, by the user's code path.

    ``picked`` is what that call runs here (:func:`charm_megatron.ops.attention.resolve_algo`:
    the same profile, topology, problem and role mix), resolved from the point's shapes; a
    pure function of them, so the same on every rank. With ``auto_tune`` (``--auto-tune``,
    ``CHARM_AUTO_TUNE``) the first (warm-up) call measures the model's shortlist:
    :meth:`resolve_pick` after the rounds reports what it measured. The profile is the
    ranks' ``CHARM_MODEL_PROFILE``, which the emulated launchers point at this run's links
    (:mod:`charm_megatron.lab.bench.autoprofile`). Not ablatable: its compute-only run would be
    its pick's, which the bench times already when the pick is a contender too.
    """

    ablatable = False

    def __init__(self, topology: str | None, causal: bool, point: Point, dtype: torch.dtype,
                 packed: dict | None = None, roles: str = "bytes",
                 settings: tuple[tuple[str, str], ...] = (), backend=None,
                 window: tuple[int, int] | None = None, partials: str | None = None,
                 auto_tune: str | None = None) -> None:
        super().__init__("auto", topology, causal, packed, roles=roles, settings=settings,
                         backend=backend, window=window, partials=partials,
                         auto_tune=auto_tune)
        world = dist.get_world_size()
        # The shapes cp_attention resolves with: sbhd, or THD as [t, 1, h, d] (the same
        # plans and role mix as sbhd).
        rows, batch = ((point.batch * point.seq // world, 1) if packed
                       else (point.seq // world, point.batch))
        scale = getattr(backend, "problem_scale", None)
        if scale is not None:  # the wire copy: the timed device's scale makes it the point
            rows, batch = rows // scale.rows, batch // scale.batch
        self._meta = tuple(torch.empty(rows, batch, h, point.head_dim, dtype=dtype,
                                       device="meta") for h in (point.heads, point.kv_heads))
        self._where = (topology, causal, window)
        self.picked_roles = roles
        self.picked = self.resolve_pick()

    def resolve_pick(self) -> str:
        """What ``auto`` runs at this point now: the model's pick, or once a call measured
        the shortlist (``auto_tune``), the measured one."""
        topology, causal, window = self._where
        return resolve_algo(*self._meta, algo="auto", topology=topology, causal=causal,
                            options=self.options, roles=self.picked_roles, window_size=window)

    def ablated(self, ablation: str) -> Contender:
        return Contender.ablated(self, ablation)


# ----------------------------------------------------------------------------- torch CP
def _cp_module():
    from torch.distributed.tensor.experimental._context_parallel import _attention as cpa

    return cpa


def _cpu_block_fwd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   is_causal: bool = False, scale: float | None = None,
                   **_: object) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU flash kernel in the shape ``_templated_ring_attention`` expects of its op."""
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, bool(is_causal), scale=scale)
    # The kernel returns lse as a non-contiguous view; the ring's merger chunks it along the
    # sequence and needs plain memory.
    return out, lse.contiguous()


def _cpu_block_bwd(*, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, out: torch.Tensor, logsumexp: torch.Tensor,
                   is_causal: bool = False, scale: float | None = None,
                   **_: object) -> tuple[torch.Tensor, ...]:
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, bool(is_causal), scale=scale)


class _TorchRingCore(torch.autograd.Function):
    """PyTorch's ring loop (forward and backward) with the CPU kernel, under one autograd node."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):  # q, k, v: [b, h, s, d]
        cpa = _cp_module()
        out, lse = cpa._templated_ring_attention(group, 2, _cpu_block_fwd, q, k, v,
                                                 is_causal=causal, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (group, causal, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.cfg
        cpa = _cp_module()
        dq, dk, dv = cpa._templated_ring_attention_backward(
            group, 2, _cpu_block_bwd, dout, "grad_out", q, k, v, out, lse,
            is_causal=causal, scale=scale)[:3]
        return dq, dk, dv, None, None, None


class TorchContender(Contender):
    """PyTorch's context-parallel ring attention (``mode`` ``api`` or ``core``, see above)."""

    name = "torch"

    def __init__(self, mode: str, causal: bool, scale: float, rotate: str,
                 device: torch.device, gqa: bool) -> None:
        self.mode, self.causal, self.scale, self.rotate = mode, causal, scale, rotate
        self.device, self.gqa = device, gqa
        self.world = dist.get_world_size()
        self._mesh = None

    def _mesh_(self):
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        cpa = _cp_module()
        saved = (cpa._cp_options.enable_load_balance, cpa._cp_options.rotate_method)
        # Load balancing (head-tail chunks) is torch's causal layout; it must be off otherwise
        # (torch raises "Load balancing requires is_causal=True").
        cpa._cp_options.enable_load_balance = self.causal
        cpa.set_rotate_method(self.rotate)
        try:
            if self.mode == "api":
                # A buffer of 2n tokens only to satisfy the API (it shards buffers and picks the
                # load balancer from their length); the real inputs are already sharded.
                dummy = torch.zeros(1, 2 * self.world, device=self.device)
                with cpa.context_parallel(self._mesh_(), buffers=[dummy], buffer_seq_dims=[1],
                                          no_restore_buffers={dummy}):
                    cpa._cp_options.enable_load_balance = self.causal
                    yield
            else:
                yield
        finally:
            cpa._cp_options.enable_load_balance, cpa._cp_options.rotate_method = saved

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # sbhd -> bhsd views
        if self.mode == "api":
            kw = {"enable_gqa": True} if self.gqa else {}
            out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=self.causal,
                                                 scale=self.scale, **kw)
        else:
            out = _TorchRingCore.apply(qb, kb, vb, dist.group.WORLD, self.causal, self.scale)
        return out.permute(2, 0, 1, 3)


def probe_torch(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int,
                causal: bool, rotate: str) -> tuple[str | None, str]:
    """Which way PyTorch's CP attention runs here: ``("api" | "core" | None, note)``.

    A collective (every rank calls it with the same arguments): a tiny forward and backward
    through the public API, then (CPU only) through the core ring; every rank's outcome is
    shared so that all ranks decide alike.
    """
    world = dist.get_world_size()
    s_local = 4
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s_local, 1, h, d, generator=g).to(device=device, dtype=dtype)
               .requires_grad_() for h in (hq, hkv, hkv))
    tried: list[str] = []
    for mode in ("api", "core") if device.type == "cpu" else ("api",):
        try:
            c = TorchContender(mode, causal, d ** -0.5, rotate, device, hq != hkv)
            with c.session():
                out = c(q, k, v)
                out.float().sum().backward()
            err = ""
        except Exception as exc:  # noqa: BLE001 - any failure means "does not run here"
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        errs: list[str] = [""] * world
        dist.all_gather_object(errs, err)
        bad = sorted({e for e in errs if e})
        if not bad:
            why = "; ".join(tried)
            note = ("public context_parallel API" if mode == "api" else
                    "torch's _templated_ring_attention (private) with the CPU kernel; the public "
                    "API does not run on CPU: " + why)
            return mode, note
        tried.append(f"{mode}: {bad[0]}")
    return None, "PyTorch context-parallel attention does not run here: " + "; ".join(tried)


# ----------------------------------------------------------------------------- the line-up
@dataclass
class Lineup:
    """The contenders of one grid point, and why any of ``cfg.algos`` is missing."""

    contenders: dict[str, Contender]
    skipped: dict[str, str]  # algo -> why it does not run here
    notes: dict[str, str]  # algo -> how it runs (torch: api or core)
    picks: dict[str, str] = field(default_factory=dict)  # auto -> the algorithm it runs


def _traits(algo: str, topology: str | None, point: Point, packed: bool, window):
    """What ``algo``'s check reads of a call at ``point`` (its groups as it sees them); the
    same on every rank."""
    from charm_megatron.plan.registry import CallTraits
    from charm_megatron.topology import Topology

    world = dist.get_world_size()
    groups = (Topology.parse(topology, world).groups if topology and uses_topology(algo)
              and topology not in ("auto", "node", "numa") else (tuple(range(world)),))
    return CallTraits(tuple(tuple(g) for g in groups), point.heads, point.kv_heads,
                      packed=packed, windowed=window is not None)


def _refusal(algo: str, topology: str | None, point: Point, packed: bool,
             window) -> str | None:
    """Why ``algo`` cannot run ``point`` (its entry's check: ``a2a`` where the heads do not
    divide by the CP size), ``None`` if it can; the same on every rank."""
    from charm_megatron.plan.registry import refusal

    return refusal(algo, _traits(algo, topology, point, packed, window))


def _te_contender(algo: str, topology: str, point: Point, cfg: BenchConfig,
                  packed: dict | None, backend, lineup: Lineup) -> None:
    """TransformerEngine's CP type ``algo`` as shipped (:mod:`charm_megatron.model.
    te_contenders`): refused where TE refuses it, else the plan that moves its blocks with
    its wire dtype, on ``backend`` (the timed device on TE's kernel curve; the kernels here
    on the CPU testbed)."""
    from charm_megatron.model.te_contenders import get as te_get
    from charm_megatron.model.te_contenders import te_refusal

    c = te_get(algo)
    why = te_refusal(algo, _traits(c.algo, topology, point, packed is not None, cfg.window))
    if why is None and c.collective and backend is not None:
        why = (f"TransformerEngine's {c.cp_comm_type} moves its bytes in NCCL ring collectives; "
               "the emulated cluster times point-to-point plans only (the model prices it: "
               "charm-megatron report te)")
    if why is not None:
        lineup.skipped[algo] = why
        return
    contender = PlanContender(c.algo, topology, cfg.causal, packed, backend=backend,
                              window=cfg.wire_window(), partials=c.partials)
    contender.name = algo
    lineup.contenders[algo] = contender
    kernel = ("TE's kernel curve" if backend is not None else "this machine's kernel")
    how = (" (point-to-point: TE's NCCL collectives are not timed as such)" if c.collective
           else "")
    lineup.notes[algo] = (f"TransformerEngine cp_comm_type {c.cp_comm_type} as shipped: our "
                          f"{c.algo} plan with its wire dtypes{how}, on {kernel}")


def line_up(cfg: BenchConfig, topology: str, point: Point, device: torch.device,
            torch_probe: dict, packed: dict | None = None, backend=None,
            te_backend=None) -> Lineup:
    """Every algorithm of ``cfg.algos`` that runs here at ``point``. ``torch_probe`` caches
    :func:`probe_torch` per head shape (a collective: every rank calls this alike); ``packed``
    holds the point's ``cu_seqlens`` in packed mode; ``backend``: the timed device of an
    emulated GPU cluster (the plan contenders run on it; torch's cannot); ``te_backend``: the
    same device on TransformerEngine's kernel curve (the ``te-*`` contenders')."""
    from charm_megatron.model.te_contenders import TE_NAMES

    lineup = Lineup({}, {}, {})
    for algo in cfg.algos:
        if algo in TE_NAMES:
            _te_contender(algo, topology, point, cfg, packed, te_backend, lineup)
            continue
        if algo == "auto":
            auto = AutoContender(topology, cfg.causal, point, DTYPES[cfg.dtype], packed,
                                 roles=cfg.roles, settings=cfg.settings, backend=backend,
                                 window=cfg.wire_window(), partials=cfg.partials,
                                 auto_tune=cfg.auto_tune)
            lineup.contenders[algo] = auto
            lineup.picks[algo] = auto.picked
            lineup.notes[algo] = f"auto picked {auto.picked} (roles {auto.picked_roles})"
            continue
        if algo != "torch":
            refusal = _refusal(algo, topology, point, packed is not None, cfg.window)
            if refusal is not None:
                lineup.skipped[algo] = refusal
                continue
            lineup.contenders[algo] = PlanContender(algo, topology, cfg.causal, packed,
                                                    roles=cfg.roles, settings=cfg.settings,
                                                    backend=backend, window=cfg.wire_window(),
                                                    partials=cfg.partials)
            continue
        if cfg.window is not None:
            lineup.skipped[algo] = ("PyTorch's context-parallel attention takes no sliding "
                                    "window (--window)")
            continue
        if backend is not None:
            lineup.skipped[algo] = ("PyTorch's context-parallel attention runs its own kernels: "
                                    "it cannot run on an emulated device")
            continue
        if packed is not None:
            lineup.skipped[algo] = ("PyTorch's context-parallel attention cannot run packed "
                                    "sequences")
            continue
        if os.environ.get(links.ENV_FLAG) == "software":
            lineup.skipped[algo] = (
                "the software link model throttles only this package's P2P calls, not torch's "
                "collectives; a torch timing would not see the slow link")
            continue
        key = (point.heads, point.kv_heads, point.head_dim)
        if key not in torch_probe:
            torch_probe[key] = probe_torch(device, DTYPES[cfg.dtype], point.heads,
                                           point.kv_heads, point.head_dim, cfg.causal,
                                           cfg.torch_rotate)
        mode, note = torch_probe[key]
        if mode is None:
            lineup.skipped[algo] = note
            continue
        lineup.notes[algo] = note
        lineup.contenders[algo] = TorchContender(mode, cfg.causal, point.head_dim ** -0.5,
                                                 cfg.torch_rotate, device,
                                                 point.heads != point.kv_heads)
    return lineup
