"""Rank functions for the failure-model tests (tests/test_cp_failures.py): injected failures,
group histories, destroy/re-init, mismatches, float64 and extreme ``dout``.

Module level so that the forkserver can pickle them. Every call passes a short explicit
timeout in its options, so a broken case fails in seconds.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from charm_megatron import cp_attention
from charm_megatron.kernels import get_backend
from charm_megatron.ops.agreement import CPAttentionError
from charm_megatron.ops.options import CPOptions
from dist_cases import local_part, local_reference, make_inputs, reference, rel_err

TIMEOUT_S = 4.0


def opts(**kw) -> CPOptions:
    return CPOptions(timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def one_call(rank: int, world: int, algo: str, topology, *, group=None, cp_rank=None,
             cp_size=None, dtype=torch.float32, dout_scale: float = 1.0, options=None,
             seed: int = 5, causal: bool = True, s_per_rank: int = 4, check_lse=True):
    """One forward+backward on ``group``; the max relative error of out, lse, dq, dk, dv vs
    the float64 reference of the rounded inputs."""
    cp_rank = rank if cp_rank is None else cp_rank
    n = world if cp_size is None else cp_size
    s, b, hq, hkv, d = s_per_rank * n, 1, 4, 2, 8
    q, k, v, dout = (t.to(dtype).double() for t in make_inputs(seed, s, b, hq, hkv, d))
    dout = (dout * dout_scale).to(dtype).double()
    scale = d ** -0.5
    ref = reference(q, k, v, dout, causal, scale)
    ql, kl, vl = (local_part(t, cp_rank, n, causal).to(dtype).requires_grad_()
                  for t in (q, k, v))
    out, lse = cp_attention(ql, kl, vl, group=group, algo=algo, topology=topology,
                            causal=causal, return_lse=True,
                            options=options if options is not None else opts())
    out.backward(local_part(dout, cp_rank, n, causal).to(dtype))
    want = local_reference(ref, cp_rank, n, causal)
    got = [out, lse, ql.grad, kl.grad, vl.grad]
    errs = {name: rel_err(g, w) for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got,
                                                      want)}
    if not check_lse:
        errs.pop("lse")
    return max(errs.values())


class FailingBackend:
    """The CPU torch kernels, raising on the ``fail_at``-th forward or backward kernel call."""

    name = "torch"

    def __init__(self, where: str, fail_at: int, sleep_s: float = 0.0) -> None:
        self.inner = get_backend("cpu", torch.float32, name="torch")
        self.where, self.fail_at, self.sleep_s, self.calls = where, fail_at, sleep_s, 0

    def _maybe_fail(self, where: str) -> None:
        if where != self.where:
            return
        self.calls += 1
        if self.calls == self.fail_at:
            if self.sleep_s:
                time.sleep(self.sleep_s)  # a straggler: peers time out, nothing raises here
            else:
                raise RuntimeError(f"injected {where} kernel failure")

    def forward(self, q, k, v, causal, scale):
        self._maybe_fail("forward")
        return self.inner.forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        self._maybe_fail("backward")
        return self.inner.backward(dout, q, k, v, out, lse, causal, scale)


def failure_then_normal_call(rank: int, world: int, algo: str, topology, where: str,
                             bad_rank: int, sleep_s: float = 0.0):
    """``bad_rank``'s 2nd kernel call fails (or stalls past the timeout); then every rank makes
    an ordinary call. Returns (error text of the failed call, seconds it took, error of the
    next call vs float64)."""
    backend = FailingBackend(where, 2, sleep_s) if rank == bad_rank else "torch"
    t0 = time.monotonic()
    text = "no error"
    try:
        one_call(rank, world, algo, topology, options=opts(backend=backend,
                                                           timeout_s=2.0 if sleep_s else 4.0))
    except (RuntimeError, CPAttentionError) as exc:
        text = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    err = max(one_call(rank, world, algo, topology, seed=s) for s in (11, 12))
    return text, took, err


def histories_differ(rank: int, world: int, case: str):
    """Ranks with different process-group histories, then CP attention on their CP groups."""
    if case == "subgroup_on_some_ranks":
        # Ranks 0 and 2 make one more group (members only) than ranks 1 and 3.
        if rank in (0, 2):
            dist.new_group([0, 2], use_local_synchronization=True)
        cp = [[0, 1], [2, 3]]
        groups = [dist.new_group(r) for r in cp]
        mine = groups[rank // 2]
        return one_call(rank, world, "rmplus", None, group=mine, cp_rank=rank % 2, cp_size=2)
    if case == "world_after_subgroups":
        if rank == 0:
            dist.new_group([0], use_local_synchronization=True)
            dist.new_group([0], use_local_synchronization=True)
        return max(one_call(rank, world, algo, topo) for algo, topo in
                   (("ring", None), ("charm", "2x2"), ("rmplus", None)))
    raise ValueError(case)


def destroy_and_reinit(rank: int, world: int, store_dir: str, rounds: int):
    """cp_attention, destroy_process_group, a new init on a new store, again ``rounds`` times."""
    from charm_megatron.ops import streams

    errs, fresh, cached = [], [], []
    for i in range(rounds):
        if i:
            dist.destroy_process_group()
            store = dist.FileStore(f"{store_dir}/store{i}", world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=30))
        errs.append(one_call(rank, world, "charm", "2x2", seed=i))
        sg = streams.stream_groups(None)
        fresh.append(not getattr(sg, "seen_by_the_test", False))  # a new entry
        sg.seen_by_the_test = True
        cp = dist.new_group([0, 1]) if i % 2 else None  # also a fresh non-default group
        if cp is not None and rank < 2:
            errs.append(one_call(rank, world, "rmplus", None, group=cp, cp_size=2))
        cached.append(len(streams._CACHE))  # entries of destroyed groups are gone
    return max(errs), fresh, cached


def _mismatched_call(rank: int, world: int, case: str):
    s, b, h, d = 4, 2, 4, 8
    shapes = {"q": (s, b, h, d), "kv": (s, b, h, d)}
    kw: dict = {"algo": "ring", "causal": True}
    dtype = torch.float32
    odd = rank == world - 1
    if case == "s_local" and odd:
        shapes = {"q": (2 * s, b, h, d), "kv": (2 * s, b, h, d)}
    elif case == "batch" and odd:
        shapes = {"q": (s, 1, h, d), "kv": (s, 1, h, d)}
    elif case == "heads" and odd:
        shapes = {"q": (s, b, 2 * h, d), "kv": (s, b, h, d)}
    elif case == "head_dim" and odd:
        shapes = {"q": (s, b, h, 2 * d), "kv": (s, b, h, 2 * d)}
    elif case == "same_bytes_other_shape" and odd:
        shapes = {"q": (s, 2 * b, h // 2, d), "kv": (s, 2 * b, h // 2, d)}
    elif case == "dtype" and odd:
        dtype = torch.float64
    elif case == "causal" and odd:
        kw["causal"] = False
    elif case == "algo" and odd:
        kw["algo"] = "rmplus"
    elif case == "topology":
        kw.update(algo="charm", topology="2x2" if odd else "4x1")
    elif case == "scale" and odd:
        kw["softmax_scale"] = 0.3
    elif case == "pass_order":
        kw.update(algo="charm", topology="2x2")
        kw["options"] = opts(pass_order="joint" if odd else "split")
    elif case == "partials":
        kw["options"] = opts(partials="fp32" if odd else "input")
    elif case == "roles":
        kw.update(algo="rmplus", roles="kv" if odd else "q")
    elif case == "bad_input_one_rank" and odd:
        shapes = {"q": (3, b, h, d), "kv": (3, b, h, d)}  # odd length under causal
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(*shapes["q"], generator=g).to(dtype)
    k = torch.randn(*shapes["kv"], generator=g).to(dtype)
    v = torch.randn(*shapes["kv"], generator=g).to(dtype)
    kw.setdefault("options", opts())
    if case == "backward_order":
        # Two calls, then the ranks run their backwards in different orders.
        qs = [q.clone().requires_grad_() for _ in range(2)]
        outs = [cp_attention(x, k, v, **kw) for x in qs]
        order = outs[::-1] if odd else outs
        for o in order:
            o.sum().backward()
        return
    out = cp_attention(q, k, v, **kw)
    out.sum().backward()


def mismatch(rank: int, world: int, case: str):
    """Every rank must raise, within bounded time; returns (exception type, message, seconds)."""
    t0 = time.monotonic()
    try:
        _mismatched_call(rank, world, case)
    except Exception as exc:  # noqa: BLE001 - the type is part of what the test checks
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "no error", "", time.monotonic() - t0


def float64_all_algos(rank: int, world: int):
    """float64 end to end for every algorithm, both masks: max error vs float64 reference."""
    return {(algo, causal): one_call(rank, world, algo, topo, dtype=torch.float64,
                                     causal=causal)
            for algo, topo in (("ring", None), ("rmplus", None), ("charm", "2x2"))
            for causal in (True, False)}


def extreme_dout(rank: int, world: int, scales: list[float], dtype_name: str):
    """Max error (out, dq, dk, dv) for dout scaled by each factor (gradients are linear in dout,
    so the float64 reference is exact for any scale)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    return {(scale, algo): one_call(rank, world, algo, topo, dtype=dtype, dout_scale=scale,
                                    check_lse=False)
            for scale in scales
            for algo, topo in (("ring", None), ("charm", "2x2"))}


def agreement_cost(rank: int, world: int, reps: int):
    """Median seconds of one tiny forward+backward with check on and off (same process)."""
    x = torch.randn(4, 1, 2, 8)
    res = {}
    for check in ("off", "every_call", "off", "every_call"):
        o = opts(check=check)
        times = []
        for _ in range(reps):
            q = x.clone().requires_grad_()
            dist.barrier()
            t0 = time.perf_counter()
            cp_attention(q, x, x, algo="ring", options=o).sum().backward()
            times.append(time.perf_counter() - t0)
        times.sort()
        res[check] = times[len(times) // 2]
    return res


def missing_peer_message(rank: int, world: int, stage: str):
    """The last rank stops calling: every other rank gets a clear error within the bound.

    ``stage``: ``first_call`` (the communicators are not made yet), ``agreement`` (made by an
    earlier call), ``transfer`` (checks off, so the first thing to wait is a transfer)."""
    x = torch.randn(4, 1, 2, 8)
    o = opts(check="off") if stage == "transfer" else opts()
    if stage != "first_call":
        cp_attention(x, x, x, algo="ring", options=o)
    if rank == world - 1:
        stay_absent_until_the_others_are_done(4 * TIMEOUT_S)
        return None
    t0 = time.monotonic()
    try:
        cp_attention(x, x, x, algo="ring", options=o)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        the_others_are_done()
    return "no error", "", time.monotonic() - t0


_DONE_KEY = "test: the others are done"


def stay_absent_until_the_others_are_done(at_most_s: float) -> None:
    """An absent peer: alive (its connections open, as a straggler's), calling nothing, until
    every other rank has finished (it said so in the process group's store) or ``at_most_s``."""
    store = dist.distributed_c10d._get_default_store()
    try:
        store.wait([_DONE_KEY], datetime.timedelta(seconds=at_most_s))
    except Exception:  # noqa: BLE001 - a timeout: the others hung; the test says so
        pass


def the_others_are_done() -> None:
    dist.distributed_c10d._get_default_store().set(_DONE_KEY, "1")


def options_in_ctx(rank: int, world: int):
    """The environment is read once per call: a backward runs with its forward's options even
    when the variables changed in between; explicit options never read the environment."""
    import os

    x = torch.randn(16, 1, 2, 8)
    q = x.clone().requires_grad_()
    os.environ["CHARM_PASS_ORDER"] = "joint"
    out = cp_attention(q, x, x, algo="auto", topology="2x2")
    os.environ["CHARM_PASS_ORDER"] = "bogus"  # would raise if backward read it
    out.sum().backward()
    fwd_order = out.grad_fn.call.options.pass_order
    explicit = cp_attention(x, x, x, algo="charm", topology="2x2",
                            options=CPOptions(pass_order="split"))
    del os.environ["CHARM_PASS_ORDER"]
    ablated = cp_attention(x.clone().requires_grad_(), x, x, algo="ring", return_lse=True,
                           options=CPOptions(ablation="compute_only"))
    return fwd_order, explicit.shape, ablated[0].grad_fn.call.options.ablation


def exchange_cost(rank: int, world: int, reps: int):
    """Median seconds of one agreement (its agree and verdict rounds) and one status exchange
    on the control channel (docs/api.md, "Cost of the checks")."""
    from charm_megatron.ops import agreement, streams

    sg = streams.stream_groups(None)
    sig = agreement.Signature(tuple((f"field {i}", i) for i in range(20)))
    res = {}
    for name, fn in (("agree", lambda: agreement.agree(sg, sig, 0, False, 30.0)),
                     ("status", lambda: agreement.report_status(sg, 0, False, 0, "", 30.0))):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        times.sort()
        res[name] = times[len(times) // 2]
    return res

def auto_with_profile(rank: int, world: int):
    """algo="auto" under options.model_profile None / "l20-pcie" (the algorithm each call
    ran), then one rank naming a profile that does not exist."""
    x = torch.randn(16, 1, 2, 8)
    algos = {}
    for profile in (None, "l20-pcie"):
        # The paper's role mix: the test needs a shape where the two clusters pick different
        # algorithms, and auto predicts with the mix that runs.
        out = cp_attention(x.clone().requires_grad_(), x, x, algo="auto", topology="2x2",
                           options=CPOptions(model_profile=profile), roles="paper")
        algos[profile] = out.grad_fn.call.algo
    try:
        cp_attention(x, x, x, algo="auto", topology="2x2", options=CPOptions(
            model_profile="no-such-profile" if rank == 1 else "l20-pcie", timeout_s=30))
        bad = ("no error", "")
    except Exception as exc:  # noqa: BLE001
        bad = (type(exc).__name__, str(exc))
    return algos, bad


def check_clean_failure(res: list, bad: int, algo: str, where: str) -> None:
    """What a kernel failure on rank ``bad`` mid-call must give, from each rank's (error text,
    seconds, error of the next calls against float64): the injected error on ``bad``, a
    CPAttentionError naming ``bad``, the algorithm and the pass on every other rank, no wait
    near a timeout, and correct calls afterwards on every rank."""
    for rank, (text, took, err) in enumerate(res):
        if rank == bad:
            assert text.startswith("RuntimeError: injected"), text
        else:
            assert text.startswith("CPAttentionError"), text
            assert f"CP rank(s) [{bad}]" in text and "injected" in text, text
            assert f"algo={algo}, {where}" in text, text
        assert took < 30, (rank, took)
        assert err < 1e-5, (rank, err)  # the next calls are correct on every rank


def home_stream_creation_fails(rank: int, world: int, bad_rank: int):
    """``bad_rank`` fails to make the home streams' communicators at the first call whose
    backward posts on them (a quarters split), then every rank makes ordinary calls. Returns
    (error text of the failed call, seconds it took, the stream groups held after the next
    call, error of the next call vs float64)."""
    from charm_megatron.ops import streams

    made = streams._new_group
    failed = []

    def fail_once(name, *args, **kw):
        if rank == bad_rank and "/home_" in name and not failed:
            failed.append(name)
            raise RuntimeError("injected communicator failure")
        return made(name, *args, **kw)

    streams._new_group = fail_once
    quarters = dict(split_visiting="quarters", roles="kv")
    t0 = time.monotonic()
    text = "no error"
    try:
        one_call(rank, world, "charm", "2x2", s_per_rank=8, options=opts(**quarters))
    except (RuntimeError, CPAttentionError) as exc:
        text = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - t0
    err = one_call(rank, world, "charm", "2x2", s_per_rank=8, seed=11, options=opts(**quarters))
    held = sorted(str(s) for s in streams.stream_groups(None).groups)
    return text, took, held, err
