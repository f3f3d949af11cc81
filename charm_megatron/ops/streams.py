"""One process group per plan stream, so kv, q and cross traffic really run concurrently (the home
streams' only once a plan posts on them: :func:`ensure_streams`), plus a
CPU control group for the agreement and status checks (ops/agreement.py, over the control
channel of ops/control.py).

On NCCL each stream group is its own communicator (its own CUDA stream inside ProcessGroupNCCL),
so a kv exchange never queues behind a q exchange; on gloo each group has its own transport
pairs and background threads. The control group is always gloo: its tiny exchanges never touch
the GPU or wait for it.

**Deterministic creation.** ``torch.distributed.new_group`` names a group after how many groups
the process made before (with ``use_local_synchronization``) or needs every rank of the world
(without): both break when ranks have different group histories (Megatron's pipeline and expert
groups differ by stage). Here the groups of a CP group are made by a collective of that group
alone: each member counts its arrival on the default store (an atomic ``add``, see
:func:`_arrive`), and once all have arrived every member creates groups named
``charm_cp/<group digest>.<epoch>/<generation>/<stream>``. Only the members take part, in the
order they make CP calls, so no earlier history matters; and no collective runs on the CP group
itself, so a rank that is late for its first call (or skips it) leaves nothing posted there. :func:`stream_groups` does this
lazily on the first ``cp_attention`` call (all ranks of a CP group make that call together);
:func:`create_stream_groups` does it eagerly (e.g. where a model is built).

**Cache.** Keyed by the CP group's registered name and ranks, each entry holding a weak
reference to the group object; an entry is used only while that same object and all its groups
are still registered, so ``destroy_process_group`` and a new ``init_process_group`` (which
reuse names and ``id``\\ s) never see stale groups. Entries whose CP group is gone are destroyed
when the group object is collected, at the next lookup, or explicitly with
:func:`release_stream_groups`.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from charm_megatron.ops.control import CONTROL_PG_TIMEOUT_S, ControlChannel
from charm_megatron.plan.core import STREAMS, Plan
from charm_megatron.plan.vocab import Stream

log = logging.getLogger(__name__)

CONTROL = "control"
# The streams every CP group gets when its groups are made; the others (the home streams of a
# split visiting pass's returns) are made by the first call whose plan posts on them
# (:func:`ensure_streams`), so a job whose plans never use them never holds their
# communicators.
BASE_STREAMS = (Stream.KV, Stream.Q, Stream.CROSS)


@dataclass(eq=False)
class StreamGroups:
    """The CP group's ranks, one process group per stream and the control group."""

    ranks: list[int]  # global rank of each CP-local rank
    groups: dict[str, dist.ProcessGroup]
    control: dist.ProcessGroup | None = None
    uid: str = ""
    generation: int = 0
    timeout_s: float = 600.0
    parent: weakref.ReferenceType | None = field(default=None, repr=False)
    # Set when a transfer failed or the ranks were out of step; the next call's agreement
    # carries it, and every rank rebuilds the stream groups together (ops/agreement.py).
    needs_rebuild: bool = False
    calls: int = 0  # forward calls made on this CP group (the same count on every rank)
    channel: ControlChannel | None = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def alive(self, group: dist.ProcessGroup) -> bool:
        """True while ``group`` is the live parent and every group made here is registered."""
        if self.parent is None or self.parent() is not group or not _registered(group):
            return False
        return all(_registered(g) for g in self._all())

    def _all(self) -> list[dist.ProcessGroup]:
        return [*self.groups.values(), *([self.control] if self.control is not None else [])]


_CACHE: dict[tuple[str, tuple[int, ...]], StreamGroups] = {}


def _registered(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


def _key(group: dist.ProcessGroup) -> tuple[str, tuple[int, ...]]:
    return (str(group.group_name), tuple(dist.get_process_group_ranks(group)))


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def control_timeout_s(timeout_s: float) -> float:
    """The control group's bound: longer than one data wait, so a rank that failed early still
    meets peers whose data waits had to run out first."""
    return 2.0 * timeout_s + 30.0


def _new_group(name: str, ranks: list[int], backend: str, timeout_s: float,
               desc: str) -> dist.ProcessGroup:
    """A process group of ``ranks`` named ``name``, made by its members only (no world-wide
    call and no dependence on this process's group count). Uses torch's own group factory
    (``_new_process_group_helper``, the one ``new_group`` calls) with the name given."""
    c10d = dist.distributed_c10d
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None or not hasattr(c10d, "_get_default_store"):  # a torch without them
        log.warning("cp_attention: this torch lacks _new_process_group_helper; stream groups "
                    "come from new_group and depend on each process's group history")
        return dist.new_group(ranks=list(ranks), timeout=_timeout(timeout_s), backend=backend,
                              use_local_synchronization=True, group_desc=desc)
    me = dist.get_rank()
    pg, _ = helper(
        len(ranks), ranks.index(me), list(ranks), backend, c10d._get_default_store(),
        c10d.GroupName(name) if hasattr(c10d, "GroupName") else name,
        timeout=_timeout(timeout_s), group_desc=desc,
    )
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


# The creation epoch this process announced for a CP group and has not built yet (its key):
# kept across a timed-out creation, so that a retry at the next call waits for the same
# epoch instead of announcing itself twice.
_ANNOUNCED: dict[tuple[str, tuple[int, ...]], int] = {}
_POLL_S = 0.01


def _arrive(key: tuple[str, tuple[int, ...]], timeout_s: float) -> str:
    """The name of this creation of CP group ``key``'s communicators, once every member has
    arrived for it (bounded by ``timeout_s``).

    Arrivals are counted on the default store (``add``: one atomic increment per member and
    creation), never by a collective on the CP group: a collective that one rank gave up on
    stays posted and pairs with whatever that group runs next, while a count is just read
    again. The ``k``-th arrival of a member belongs to epoch ``(k - 1) // size``; the groups
    are named after the epoch, so a later creation (after a failed one, or after
    ``destroy_process_group`` on the same store) never meets an earlier one's names. A rank
    that gave up waiting keeps its arrival: at its next call it waits for the same epoch,
    which a late peer's arrival then completes."""
    c10d = dist.distributed_c10d
    store = c10d._get_default_store()
    name, ranks = key
    counter = f"charm_cp/arrivals/{name}/{','.join(map(str, ranks))}"
    epoch = _ANNOUNCED.get(key)
    if epoch is None:
        epoch = (int(store.add(counter, 1)) - 1) // len(ranks)
        _ANNOUNCED[key] = epoch
    target = (epoch + 1) * len(ranks)
    deadline = time.monotonic() + timeout_s
    while int(store.add(counter, 0)) < target:
        if time.monotonic() >= deadline:
            have = int(store.add(counter, 0)) - epoch * len(ranks)
            raise RuntimeError(
                f"cp_attention: creating the communicators of CP group {list(ranks)}: "
                f"{have} of its {len(ranks)} ranks arrived within {timeout_s:g} s. Likely "
                "causes: not every rank of the CP group called cp_attention (or "
                "create_stream_groups) with this group, a rank died or is still busy, or "
                "ranks passed different CP groups; the bound is CHARM_COMM_TIMEOUT_S / "
                "CPOptions.timeout_s. This rank's arrival is kept: its next call waits for "
                "the others again")
        time.sleep(_POLL_S)
    digest = hashlib.blake2b(counter.encode(), digest_size=6).hexdigest()
    return f"{digest}.{epoch}"


def _build(group: dist.ProcessGroup, ranks: list[int], timeout_s: float, uid: str,
           generation: int) -> StreamGroups:
    backend = str(dist.get_backend(group)).lower()
    groups = {}
    for name in BASE_STREAMS:
        groups[name] = _new_group(f"charm_cp/{uid}/{generation}/{name}", ranks, backend,
                                  timeout_s, f"charm_cp_{name}")
    control = _new_group(f"charm_cp/{uid}/{generation}/{CONTROL}", ranks, "gloo",
                         control_timeout_s(timeout_s), "charm_cp_control")
    # Made within the call's bound; then its operations live long, because every wait on it is
    # bounded by the call instead and an exchange given up on must stay alive until the late
    # rank completes it (ops/control.py).
    _set_op_timeout(control, CONTROL_PG_TIMEOUT_S)
    _connect(backend, groups.values())
    return StreamGroups(list(ranks), groups, control, uid, generation, timeout_s,
                        weakref.ref(group), channel=ControlChannel(control, len(ranks)))


def _connect(backend: str, groups) -> None:
    """NCCL creates communicators lazily, and a batched P2P call as a communicator's first
    operation must involve every rank; one tiny all-reduce per stream group creates them up
    front, collectively (nothing to do on gloo)."""
    if "nccl" not in backend:
        return
    probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    for g in groups:
        dist.all_reduce(probe, group=g)


def ensure_streams(sg: StreamGroups, plan: Plan) -> None:
    """Make the groups of the streams ``plan`` posts on that ``sg`` does not hold yet (the
    home streams, :data:`BASE_STREAMS`). A collective of the CP group's members: every rank
    runs the same plan (the agreement checks it) and calls this before the plan's first op,
    so all make the same groups, in :data:`STREAMS` order, under the same names."""
    missing = [name for name in STREAMS if name in plan.streams and name not in sg.groups]
    if not missing or sg.size == 1:
        return
    group = sg.parent() if sg.parent is not None else None
    backend = str(dist.get_backend(group if group is not None else dist.group.WORLD)).lower()
    made: dict[str, dist.ProcessGroup] = {}
    try:
        for name in missing:
            made[name] = _new_group(f"charm_cp/{sg.uid}/{sg.generation}/{name}", sg.ranks,
                                    backend, sg.timeout_s, f"charm_cp_{name}")
        _connect(backend, made.values())
    except Exception as exc:
        # Half-made groups are never used: the caller (ops/plan_run.py) runs this inside the
        # call's guarded work, so the failure marks the communicators for rebuilding, which
        # every rank does together at its next call under a new generation's names.
        sg.needs_rebuild = True
        for g in made.values():
            _destroy_quietly(g)
        raise RuntimeError(
            f"cp_attention: creating the communicators of stream(s) "
            f"{[str(n) for n in missing]} of CP group {sg.ranks} failed "
            f"({type(exc).__name__}: {exc}). Likely causes: a rank of the CP group did not "
            "reach this call or died, or is still busy past CHARM_COMM_TIMEOUT_S / "
            "CPOptions.timeout_s; every rank rebuilds its communicators at the next call"
        ) from exc
    sg.groups.update(made)


def _set_op_timeout(group: dist.ProcessGroup, seconds: float) -> None:
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None:  # a torch without it: the creation bound stays the operations' bound
        log.warning("cp_attention: this torch cannot lengthen the control group's timeout; an "
                    "exchange a late rank completes after it is lost")
        return
    setter(_timeout(seconds), group)


def _destroy_quietly(g: dist.ProcessGroup) -> None:
    if _registered(g):
        try:
            dist.destroy_process_group(g)
        except Exception as exc:  # noqa: BLE001 - a broken group may fail to shut down
            log.warning("cp_attention: could not destroy a stream group: %s", exc)


def _destroy(sg: StreamGroups) -> None:
    for g in sg._all():
        _destroy_quietly(g)
    sg.groups, sg.control = {}, None


def _sweep() -> None:
    """Destroy and forget the groups of CP groups that no longer exist."""
    for key, sg in list(_CACHE.items()):
        parent = sg.parent() if sg.parent is not None else None
        if parent is None or not _registered(parent) or not sg.alive(parent):
            del _CACHE[key]
            _destroy(sg)


def stream_groups(group: dist.ProcessGroup | None, timeout_s: float = 600.0) -> StreamGroups:
    """The per-stream and control groups of CP group ``group`` (``None``: the default group),
    created on first use by a collective of ``group``'s members, then cached.

    Every member of ``group`` must reach its first call together (as ``cp_attention`` calls do).
    A group whose transfers failed (``needs_rebuild``) is rebuilt here only when the caller asks
    for it (:func:`rebuild`), because all ranks must rebuild together.
    """
    if group is None:
        group = dist.group.WORLD
    key = _key(group)
    cached = _CACHE.get(key)
    if cached is not None and cached.alive(group):
        return cached
    # Groups made anew (the control group failed, or the process group was re-created) keep
    # counting calls where the old ones stopped, as the other ranks' do; calls that failed
    # before any groups existed count too (calls pair by number, ops/agreement.py).
    calls = (cached.calls if cached is not None else 0) + _CALLS_WITHOUT_GROUPS.pop(key, 0)
    _sweep()
    ranks = list(key[1])
    if len(ranks) == 1:
        sg = StreamGroups(ranks, {}, None, "", 0, timeout_s, weakref.ref(group))
    else:
        uid = _arrive(key, timeout_s)
        # Whatever happens now, this epoch is spent: a failed build arrives anew next time.
        del _ANNOUNCED[key]
        sg = _build(group, ranks, timeout_s, uid, 0)
    sg.calls = calls
    _CACHE[key] = sg
    # When the CP group object itself goes away, its communicators go with it (destroying a
    # process group is local: no peer is involved).
    weakref.finalize(group, _release_entry, key, sg).atexit = False  # not at shutdown
    return sg


def _release_entry(key: tuple[str, tuple[int, ...]], sg: StreamGroups) -> None:
    if _CACHE.get(key) is sg:
        del _CACHE[key]
    try:
        if dist.is_available() and dist.is_initialized():
            _destroy(sg)
    except Exception:  # noqa: BLE001 - best effort, possibly at interpreter shutdown
        pass


_CALLS_WITHOUT_GROUPS: dict[tuple[str, tuple[int, ...]], int] = {}


def count_call_without_groups(group: dist.ProcessGroup | None) -> None:
    """Count a ``cp_attention`` call on ``group`` whose communicators could not be made (a
    peer was late for it): it keeps its number, like every call, so that a late peer's calls
    pair with the right ones once the communicators exist."""
    key = _key(dist.group.WORLD if group is None else group)
    _CALLS_WITHOUT_GROUPS[key] = _CALLS_WITHOUT_GROUPS.get(key, 0) + 1


def create_stream_groups(group: dist.ProcessGroup | None = None,
                         timeout_s: float = 600.0) -> StreamGroups:
    """Create CP group ``group``'s communicators now (a collective of ``group``'s members).

    The explicit form for the bare API: call it on every rank of each CP group where the model
    is built; later ``cp_attention`` calls reuse what it made. Without it the first call does
    the same thing."""
    return stream_groups(group, timeout_s)


def rebuild(sg: StreamGroups, generation: int) -> StreamGroups:
    """New stream communicators for ``sg``, generation ``generation`` (called on every rank
    together, after an agreement in which some rank asked for it; the generation is the same
    on every rank). The control group is kept: it carried the decision."""
    group = sg.parent() if sg.parent is not None else None
    if group is None:
        group = dist.group.WORLD
    backend = str(dist.get_backend(group)).lower()
    old = dict(sg.groups)
    sg.generation = generation
    sg.groups = {name: _new_group(f"charm_cp/{sg.uid}/{sg.generation}/{name}", sg.ranks,
                                  backend, sg.timeout_s, f"charm_cp_{name}")
                 for name in BASE_STREAMS}  # the others made again when a plan needs them
    sg.needs_rebuild = False
    for g in old.values():
        if _registered(g):
            try:
                dist.destroy_process_group(g)
            except Exception as exc:  # noqa: BLE001
                log.warning("cp_attention: could not destroy a failed stream group: %s", exc)
    _connect(backend, sg.groups.values())
    return sg


def release_stream_groups(group: dist.ProcessGroup | None = None) -> None:
    """Destroy the communicators made for CP group ``group`` (all of them with ``None`` after
    ``destroy_process_group``: entries whose group is gone are dropped anyway)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        for sg in list(_CACHE.values()):
            sg.groups, sg.control = {}, None
        _CACHE.clear()
        return
    target = dist.group.WORLD if group is None else group
    key = _key(target)
    sg = _CACHE.pop(key, None)
    if sg is not None:
        _destroy(sg)
    _sweep()
