"""``charm-megatron topo``: probe and print the CP topology of a running job.

Run one process per rank, as the training job would (torchrun, srun, or plain env:// variables
``RANK WORLD_SIZE MASTER_ADDR MASTER_PORT``; under srun the SLURM variables are mapped when the
torchrun ones are absent). Without any of them it describes this one process. CP groups are
contiguous blocks of ``--cp-size`` global ranks (Megatron's layout when TP = PP = 1; for other
layouts, run it with the CP size as the whole world).

Global rank 0 prints, per CP rank: host, NUMA node, device, launcher hints, group and local
index; then the level chosen and why. ``--measure`` adds a point-to-point bandwidth matrix inside
the first CP group and checks it against the grouping.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import time
from collections.abc import Mapping
from typing import Any

from charm_megatron.topology.core import Topology, format_ranks
from charm_megatron.topology.probing import LEVELS, ProbeResult, RankFacts, probe
from charm_megatron.topology.resolve import ENV_VAR, resolve_topology

__all__ = ["launcher_env", "register", "run"]

# A grouping "contradicts" the measurement when cross-group pairs are not clearly slower.
_CONTRADICTION_RATIO = 0.8


def register(parser: argparse.ArgumentParser) -> None:
    """Add the ``topo`` arguments to ``parser``."""
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="process-group backend (default: nccl with CUDA, else gloo)")
    parser.add_argument("--level", choices=LEVELS, default="auto",
                        help="probe level: node, numa, flat, or auto (node if several hosts, "
                             "else numa if several NUMA nodes, else flat)")
    parser.add_argument("--cp-size", type=int, default=None,
                        help="ranks per CP group (default: world size); CP groups are "
                             "contiguous blocks of global ranks")
    parser.add_argument("--topology", default=None, metavar="TEXT",
                        help="check an explicit topology (2x4, 0-3,4-7, ...) instead of the "
                             "probed one (default: CHARM_TOPOLOGY if set)")
    parser.add_argument("--measure", action="store_true",
                        help="measure point-to-point bandwidth between every pair of CP group 0")
    parser.add_argument("--size-mb", type=float, default=8.0, help="message size for --measure")
    parser.add_argument("--reps", type=int, default=3, help="messages per direction and pair")
    parser.add_argument("--all-groups", action="store_true",
                        help="print the table of every CP group, not only the first")
    parser.add_argument("--timeout-s", type=float, default=120.0,
                        help="timeout of every collective (seconds)")


# --------------------------------------------------------------------------- launcher
def _first_host(nodelist: str) -> str | None:
    """First host of a SLURM host list: ``gpu[003-004,7],x1`` -> ``gpu003``."""
    m = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return None
    prefix, bracket = m.group(1), m.group(2)
    if not bracket:
        return prefix
    return prefix + re.split(r"[,-]", bracket)[0]


def launcher_env(env: Mapping[str, str]) -> dict[str, str]:
    """The env:// variables for this process: torchrun's if present, else mapped from SLURM.

    Returns the variables to *add* (empty when torchrun's are complete or nothing is known).
    """
    out: dict[str, str] = {}
    if "RANK" in env and "WORLD_SIZE" in env:
        return out
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return out
    out["RANK"] = env["SLURM_PROCID"]
    out["WORLD_SIZE"] = env["SLURM_NTASKS"]
    if "LOCAL_RANK" not in env and "SLURM_LOCALID" in env:
        out["LOCAL_RANK"] = env["SLURM_LOCALID"]
    if "MASTER_ADDR" not in env:
        host = _first_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
        host = host or env.get("SLURM_LAUNCH_NODE_IPADDR")
        if host:
            out["MASTER_ADDR"] = host
    if "MASTER_PORT" not in env:
        # Same on every rank of the job, different between jobs sharing a node.
        job = env.get("SLURM_JOB_ID", "0")
        out["MASTER_PORT"] = str(29500 + (int(job) % 1000 if job.isdigit() else 0))
    return out


def _init(args: argparse.Namespace) -> bool:
    """Initialise torch.distributed unless it already is; True if we did (and must destroy)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ.update(launcher_env(os.environ))
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    return True


# --------------------------------------------------------------------------- measurement
def _measure(group: Any, members: list[int], size_bytes: int, reps: int,
             timeout_s: float) -> dict[tuple[int, int], float]:
    """Bandwidth (bytes/s) from CP rank i to j for every ordered pair, one pair at a time.

    Returns the rates this rank measured as receiver. For each direction the receiver sends a
    one-element "ready" and times from then to the payload's arrival (median of ``reps``), so a
    late sender does not count as a slow link. A barrier between pairs keeps them sequential:
    concurrent pairs would share links and cores and blur the matrix.
    """
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    n = len(members)
    payload = torch.zeros(max(1, size_bytes // 4), dtype=torch.float32)
    token = torch.zeros(1, dtype=torch.float32)
    mine: dict[tuple[int, int], float] = {}
    # Ranks outside CP group 0 wait for us in a collective bounded by the same timeout.
    deadline = time.monotonic() + 0.8 * timeout_s
    for i in range(n):
        for j in range(i + 1, n):
            if me in (i, j):
                for src, dst in ((i, j), (j, i)):
                    times = []
                    for _ in range(reps):
                        if me == dst:
                            t0 = time.perf_counter()
                            dist.send(token, members[src], group=group)
                            dist.recv(payload, members[src], group=group)
                            times.append(time.perf_counter() - t0)
                        elif me == src:
                            dist.recv(token, members[dst], group=group)
                            dist.send(payload, members[dst], group=group)
                    if me == dst:
                        mine[(src, dst)] = payload.numel() * 4 / statistics.median(times)
            dist.barrier(group=group)
            if time.monotonic() > deadline:
                raise TimeoutError(f"--measure took longer than {timeout_s:.0f} s; use a smaller "
                                   "--size-mb or --reps")
    return mine


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _format_matrix(topo: Topology, rates: dict[tuple[int, int], float], size_mb: float,
                   reps: int) -> list[str]:
    n = topo.size
    lines = [f"point-to-point bandwidth in CP group 0, GB/s ({size_mb:g} MB messages, median of "
             f"{reps}; row = sender, column = receiver; * = cross-group):"]
    lines.append("       " + "".join(f"{j:>8}" for j in range(n)))
    for i in range(n):
        cells = []
        for j in range(n):
            if i == j:
                cells.append(f"{'-':>8}")
            else:
                mark = "*" if topo.group_of(i) != topo.group_of(j) else " "
                cells.append(f"{rates[(i, j)] / 1e9:>7.3f}{mark}")
        lines.append((f"  {i:>4} " + "".join(cells)).rstrip())
    return lines


def check_measurement(topo: Topology, rates: dict[tuple[int, int], float]) -> tuple[list[str], list[str]]:
    """Summary lines and warnings comparing measured pair rates with ``topo``'s grouping."""
    intra = [v for (i, j), v in rates.items() if topo.group_of(i) == topo.group_of(j)]
    cross = [v for (i, j), v in rates.items() if topo.group_of(i) != topo.group_of(j)]
    mi, mc = _median(intra), _median(cross)
    lines, warns = [], []

    def gb(x: float | None) -> str:
        return "n/a" if x is None else f"{x / 1e9:.3f} GB/s"

    lines.append(f"intra-group median {gb(mi)} ({len(intra)} directed pairs), cross-group median "
                 f"{gb(mc)} ({len(cross)} directed pairs)"
                 + (f", cross/intra = {mc / mi:.2f}" if mi and mc else ""))
    if mi is not None and mc is not None and mc >= _CONTRADICTION_RATIO * mi:
        warns.append(
            f"WARNING: the grouping {topo} contradicts the measurement: cross-group links "
            f"({gb(mc)}) are not clearly slower than intra-group links ({gb(mi)}). CHARM+ gains "
            "nothing from this grouping; check the hosts/NUMA nodes above, or set "
            "CHARM_TOPOLOGY=flat / another grouping"
        )
    if topo.is_flat and rates:
        lo, hi = min(rates.values()), max(rates.values())
        if hi > 3 * lo:
            slow = sorted((v, p) for p, v in rates.items())[: max(1, len(rates) // 4)]
            warns.append(
                f"WARNING: the topology is flat but pair rates range from {gb(lo)} to {gb(hi)} "
                f"(slowest pairs: {', '.join(f'{a}->{b}' for _, (a, b) in slow)}); the CP group "
                "probably spans slow links: try --level node / numa, or set CHARM_TOPOLOGY "
                "to the groups of fast pairs"
            )
    return lines, warns


# --------------------------------------------------------------------------- printing
def _launcher_text(f: RankFacts) -> str:
    short = {"SLURM_NODEID": "node", "SLURM_LOCALID": "slurm_local", "LOCAL_RANK": "local",
             "LOCAL_WORLD_SIZE": "local_world", "GROUP_RANK": "group_rank"}
    return ",".join(f"{short.get(k, k)}={v}" for k, v in f.launcher) or "-"


def _table(result: ProbeResult, topo: Topology) -> list[str]:
    rows = [("cp", "rank", "host", "numa", "device", "launcher", "group", "local")]
    for f in result.facts:
        rows.append((str(f.rank), str(f.global_rank), f.host, str(f.numa) if f.numa >= 0 else "?",
                     f.device, _launcher_text(f), str(topo.group_of(f.rank)),
                     str(topo.local_index(f.rank))))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _describe(idx: int, members: list[int], result: ProbeResult, chosen: Topology,
              source: str, full: bool) -> list[str]:
    lines = [f"CP group {idx} (global ranks {format_ranks(members)}): {chosen}"
             + ("" if source == "probe" else f" [{source}]")]
    if full:
        lines += _table(result, chosen)
    lines.append(f"  level: {result.level} (requested {result.requested}) - {result.reason}")
    if source != "probe":
        lines.append(f"  probe found {result.topology}; using {chosen} from {source}")
    groups = " / ".join(format_ranks(g) for g in chosen.groups)
    lines.append(f"  topology: {chosen}  ({chosen.num_groups} group(s) of {chosen.group_size}: {groups})")
    if result.warning:
        lines += [f"  WARNING: {w}" for w in result.warning.splitlines()]
    return lines


# --------------------------------------------------------------------------- entry point
def run(args: argparse.Namespace) -> int:
    """Probe, gather, print on global rank 0; returns 0, or 2 on a usage error."""
    import torch.distributed as dist

    ours = _init(args)
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        cp = args.cp_size or world
        if cp < 1 or world % cp:
            if rank == 0:
                print(f"charm-megatron topo: --cp-size {cp} does not divide the world size {world}")
            return 2
        blocks = [list(range(b * cp, b * cp + cp)) for b in range(world // cp)]
        group = None
        if len(blocks) > 1:
            # new_group is collective over the world: every rank creates every block, in order.
            for members in blocks:
                g = dist.new_group(members)
                if rank in members:
                    group = g
        idx = rank // cp
        result = probe(group, args.level)
        explicit = args.topology or os.environ.get(ENV_VAR, "").strip() or None
        source = "probe"
        error = None
        chosen = result.topology
        if explicit is not None:
            source = "--topology" if args.topology else f"{ENV_VAR}={explicit}"
            try:
                chosen = resolve_topology(explicit, group, cp, source=source)
            except ValueError as exc:
                error = str(exc)
        rates: dict[tuple[int, int], float] = {}
        if args.measure and idx == 0 and cp > 1:
            rates = _measure(group, blocks[0], int(args.size_mb * 1e6), max(1, args.reps),
                             args.timeout_s)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (idx, result, chosen, error, rates))
        if rank == 0:
            backend = dist.get_backend()
            print(f"charm-megatron topo: world {world}, backend {backend}, CP size {cp} -> "
                  f"{len(blocks)} CP group(s) (contiguous blocks of {cp} global ranks)")
            firsts = {}
            all_rates: dict[tuple[int, int], float] = {}
            for g_idx, res, ch, err, r in gathered:
                firsts.setdefault(g_idx, (res, ch, err))
                all_rates.update(r)
            for g_idx in sorted(firsts):
                res, ch, err = firsts[g_idx]
                print()
                for line in _describe(g_idx, blocks[g_idx], res, ch, source,
                                      full=args.all_groups or g_idx == 0):
                    print(line)
                if err:
                    print(f"  ERROR: {err}")
            res0, ch0, err0 = firsts[0]
            if all_rates and not err0:
                print()
                for line in _format_matrix(ch0, all_rates, args.size_mb, max(1, args.reps)):
                    print(line)
                lines, warns = check_measurement(ch0, all_rates)
                for line in lines + warns:
                    print(line)
            print()
            if source == "probe":
                print(f"CHARM+ will use {ch0} (probed). To pin it: {ENV_VAR}={ch0} or "
                      f"--charm-topology {ch0}; to change it: --level / {ENV_VAR}=flat|node|numa|GxM")
            elif err0 is None:
                print(f"CHARM+ will use {ch0} ({source}).")
        return 2 if any(e for _, _, _, e, _ in gathered) else 0
    finally:
        if ours:
            dist.destroy_process_group()
