"""``charm-megatron demo`` (what ``make demo`` runs): train a config with ring and with CHARM+ on
CPU ranks over an emulated two-node cluster, then compare the Megatron-LM logs.

Steps (see ``docs/demo.md``):

1. Load the config (``gpt-tiny-cpu``, run ``demo-s4096-gb1`` by default).
2. The link: with root and iproute2, an :class:`~charm_megatron.lab.emulate.EmulatedCluster` of
   ``G`` nodes x ``M`` ranks (the config's ``charm_topology``, ``2x2``): network namespaces, one
   shared cross-node link per node (``--nic rank``: one per rank) shaped to ``--cross-rate``, intra-node traffic shaped to
   ``--intra-rate``; the rates are measured and printed. Otherwise plain loopback, and the
   output says that no slow link is emulated and why.
3. :func:`charm_megatron.train_demo.train.train_rank` on every rank: megatron-core's GPTModel,
   mock data, one model per comm type, iterations taking turns; rank 0 prints the progress bar
   and writes ``<out>/<config>/<run>/<comm>/train-demo.log`` in Megatron-LM's format, plus the
   ``meta.json`` that ``scripts/slurm/launch.sh`` writes.
4. ``charm-megatron compare`` on the two logs (the table), the median iteration times and the
   speed-up, and the loss check: the ``lm loss`` curves must agree within ``--tolerance``
   (relative); otherwise the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from charm_megatron.lab.emulate import NIC_MODELS, EmulatedCluster, available, run_ranks_in_cluster
from charm_megatron.launch.args_cli import build_argv, command
from charm_megatron.launch.compare import DEFAULT_SKIP, compare, format_table, parse_log, write_csv
from charm_megatron.launch.config import ConfigError, list_runs, load_config, parse_set
from charm_megatron.local_ranks import RankFailure, run_ranks
from charm_megatron.topology import Topology
from charm_megatron.train_demo.train import TrainSpec, summarize, train_rank

__all__ = ["DEFAULT_CONFIG", "DEFAULT_RUN", "DemoResult", "add_arguments", "main", "run_demo"]

DEFAULT_CONFIG = "gpt-tiny-cpu"
DEFAULT_RUN = "demo-s4096-gb1"
DEFAULT_OUT = os.path.join("runs", "demo")
#: Cross-node link 1/8 of the intra-node one, slow enough that the ring waits on it.
DEFAULT_CROSS_RATE = "100mbit"
DEFAULT_INTRA_RATE = "800mbit"
#: One cross-node link per node (a dual-NUMA PCIe box); ``rank``: one per rank (one NIC per GPU).
DEFAULT_NIC = "node"
DEFAULT_TOLERANCE = 1e-4
COMM_TYPES = ("ring", "charm")
LOG_NAME = "train-demo.log"


@dataclass
class DemoResult:
    """What :func:`run_demo` found; ``rc`` is the exit status (0 ok, 1 losses disagree)."""

    rc: int
    mode: str
    log_paths: dict[str, Path]
    median_ms: dict[str, float]
    speedup: float | None
    loss_abs_diff: float
    loss_rel_diff: float
    records: dict[str, list[dict]] = field(default_factory=dict)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training demo's options (``charm-megatron demo ...``)."""
    g = parser.add_argument_group("training demo (the default)")
    g.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"config name or YAML file (default {DEFAULT_CONFIG})")
    g.add_argument("--run", default=None,
                   help=f"run of the config (default {DEFAULT_RUN} for {DEFAULT_CONFIG}, else "
                   "the config's first run)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as in `charm-megatron args` (e.g. seq_length=1024, "
                   "num_query_groups=4); repeatable")
    g.add_argument("--out", default=DEFAULT_OUT,
                   help=f"output directory for <config>/<run>/<comm>/{LOG_NAME}, meta.json and "
                   f"compare.csv (default ./{DEFAULT_OUT})")
    g.add_argument("--link", choices=("auto", "netns", "loopback"), default="auto",
                   help="auto: emulated nodes with a slow link when root and iproute2 allow, else "
                   "loopback; netns: fail if that is impossible; loopback: no slow link")
    g.add_argument("--cross-rate", default=DEFAULT_CROSS_RATE,
                   help=f"cross-node link per node (tc units or GB/s; default {DEFAULT_CROSS_RATE})")
    g.add_argument("--intra-rate", default=DEFAULT_INTRA_RATE,
                   help=f"intra-node link per node, 'none' = unshaped loopback (default "
                   f"{DEFAULT_INTRA_RATE})")
    g.add_argument("--nic", choices=NIC_MODELS, default=DEFAULT_NIC,
                   help="node: a node's ranks share one cross-node link (a dual-NUMA PCIe box); "
                   f"rank: one cross-node link per rank (one NIC per GPU). Default {DEFAULT_NIC}")
    g.add_argument("--skip", type=int, default=None,
                   help="warm-up iterations left out of the timing (default: compare's, 2)")
    g.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help=f"largest relative lm-loss difference accepted (default {DEFAULT_TOLERANCE:g})")
    g.add_argument("--timeout-s", type=float, default=1800.0,
                   help="limit for the whole training job (default 1800)")


def _parse_overrides(items: Sequence[str]) -> dict[str, str]:
    return parse_set(list(items))


def _write_meta(cfg: Any, comm: str, path: Path, extra: dict[str, Any]) -> None:
    """``meta.json`` as ``scripts/slurm/launch.sh`` writes it (``args --format json``), plus
    what the demo adds (link, rates)."""
    payload = dict(cfg.summary(), comm_type=comm, command=command(cfg, comm, "python"),
                   argv=build_argv(cfg, comm), demo=extra)
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def _link_mode(requested: str) -> tuple[str, str]:
    """(``netns`` | ``loopback``, why)."""
    if requested == "loopback":
        return "loopback", "--link loopback"
    ok, why = available()
    if ok:
        return "netns", "root and iproute2 available"
    if requested == "netns":
        raise ValueError(f"--link netns: cannot emulate a cluster here: {why}")
    return "loopback", why


def run_demo(
    config: str = DEFAULT_CONFIG,
    run: str | None = None,
    overrides: dict[str, str] | None = None,
    out: str | os.PathLike[str] = DEFAULT_OUT,
    link: str = "auto",
    cross_rate: str = DEFAULT_CROSS_RATE,
    intra_rate: str | None = DEFAULT_INTRA_RATE,
    nic: str = DEFAULT_NIC,
    skip: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    timeout_s: float = 1800.0,
    comm_types: Sequence[str] = COMM_TYPES,
    stream: TextIO | None = None,
) -> DemoResult:
    """Train ``config``/``run`` once per comm type on CPU ranks, write the logs, compare them.

    Prints as it goes (to ``stream``, default stdout; the ranks' progress bar goes to the
    process's stdout). Raises ``ConfigError`` for a bad config / override, ``RankFailure`` when
    a rank fails; returns :class:`DemoResult` otherwise.
    """
    def say(text: str = "") -> None:
        print(text, file=stream or sys.stdout, flush=True)

    if run is None:
        run = DEFAULT_RUN if config == DEFAULT_CONFIG else list_runs(config)[0]
    cfg = load_config(config, run, overrides or {})
    v = dict(cfg.values)
    world = cfg.world_size
    cp = int(v["context_parallel_size"])
    topo_text = v["charm_topology"] or "flat"
    topology = Topology.parse(topo_text, cp_size=cp)
    skip = DEFAULT_SKIP if skip is None else skip
    if v["train_iters"] <= max(skip, v["lr_warmup_iters"] or 0):
        raise ValueError(f"train_iters {v['train_iters']} must exceed the warm-up ({skip} skipped "
                         f"iterations, lr_warmup_iters {v['lr_warmup_iters']})")
    if world != cp:
        raise ValueError(f"the demo emulates one CP group: world size {world} must equal CP {cp}")
    if nic not in NIC_MODELS:
        raise ValueError(f"nic must be 'node' (one cross link per node) or 'rank' (one per "
                         f"rank), got {nic!r}")
    mode, why = _link_mode(link)
    intra = None if intra_rate in (None, "none", "") else intra_rate

    out_root = Path(out)
    run_dir = out_root / cfg.config_name / cfg.run_name
    log_paths = {c: run_dir / c / LOG_NAME for c in comm_types}
    say(f"charm-megatron demo: train {cfg.config_name} run {cfg.run_name} with megatron-core "
        f"GPTModel on {world} CPU ranks (gloo), CP {cp}, once per comm type: "
        f"{', '.join(comm_types)}")
    say(f"  model: {v['num_layers']} layers, hidden {v['hidden_size']}, "
        f"{v['num_attention_heads']} heads / {v['num_query_groups'] or v['num_attention_heads']} "
        f"KV heads, seq {v['seq_length']}, global batch {v['global_batch_size']}, "
        f"{v['train_iters']} iterations ({skip} warm-up), {v['precision']}, mock data")
    say(f"  CHARM+ topology: {topology} ({topology.num_groups} groups of {topology.group_size})"
        + (f"; overrides: {' '.join(f'{k}={x}' for k, x in overrides.items())}"
           if overrides else ""))

    meta_extra: dict[str, Any] = {"link": mode, "nic": nic, "topology": str(topology),
                                  "overrides": dict(overrides or {})}
    measured_cross: float | None = None
    t_start = time.perf_counter()
    if mode == "netns":
        if topology.num_groups < 2:
            raise ValueError(f"topology {topology} has one group: nothing to put on a slow link")
        if [list(g) for g in topology.groups] != [
                list(range(g * topology.group_size, (g + 1) * topology.group_size))
                for g in range(topology.num_groups)]:
            raise ValueError(f"the emulated cluster places consecutive ranks on a node; "
                             f"topology {topology} is not GxM")
        cluster = EmulatedCluster(groups=topology.num_groups,
                                  ranks_per_group=topology.group_size,
                                  cross_rate=cross_rate, intra_rate=intra, nic=nic)
        with cluster:
            rates = cluster.measure_rates(seconds=0.3, concurrent=True)
            say(f"  link: emulated cluster (network namespaces, tc tbf; {why}): "
                f"{topology.num_groups} nodes x {topology.group_size} ranks, "
                + ("one shared cross-node link per node" if nic == "node"
                   else "one cross-node link per rank (one NIC per GPU)"))
            say("    measured: " + str(rates).replace("\n", "\n              "))
            measured_cross = rates.cross
            meta_extra.update(cross_rate=cluster.cross_rate, intra_rate=cluster.intra_rate,
                              measured_cross=rates.cross, measured_intra=rates.intra,
                              measured_cross_concurrent=rates.cross_concurrent)
            spec = _spec(cfg, v, comm_types, log_paths, topo_text, skip)
            _prepare_dirs(cfg, comm_types, log_paths, meta_extra)
            say("  training (rank 0 prints each iteration; times are the slowest rank's):")
            per_rank = run_ranks_in_cluster(cluster, train_rank, spec, timeout_s=timeout_s,
                                            pg_timeout_s=120.0)
    else:
        say(f"  link: LOOPBACK - no slow link is emulated ({why}); every rank talks over "
            "this machine's loopback, so the times below show overheads, not the cross-node "
            "effect CHARM+ targets (run as root with iproute2 for the emulated cluster)")
        spec = _spec(cfg, v, comm_types, log_paths, topo_text, skip)
        _prepare_dirs(cfg, comm_types, log_paths, meta_extra)
        say("  training (rank 0 prints each iteration; times are the slowest rank's):")
        per_rank = run_ranks(train_rank, world, spec, timeout_s=timeout_s, pg_timeout_s=120.0)
    wall = time.perf_counter() - t_start
    records = per_rank[0]

    # The comparison, from the logs, as a user would run it.
    say(f"\n  trained in {wall:.0f} s; logs: {run_dir}/{{{','.join(comm_types)}}}/{LOG_NAME}")
    say(f"\n$ charm-megatron compare {' '.join(str(p) for p in log_paths.values())}")
    rows = compare([str(p) for p in log_paths.values()], skip=skip)
    say(format_table(rows))
    csv_path = write_csv(rows, out_root / "compare.csv")
    say(f"wrote {csv_path}")

    # Consistency: the logs hold every iteration and the loss the ranks computed.
    rc = 0
    for comm, path in log_paths.items():
        entries = parse_log(path).entries
        if len(entries) != v["train_iters"] or any(
                e.lm_loss is None or abs(e.lm_loss - r["lm_loss"]) > 1e-6 * abs(r["lm_loss"])
                for e, r in zip(entries, records[comm])):
            say(f"ERROR: {path} does not hold the {v['train_iters']} iterations the ranks ran")
            rc = 1

    summary = summarize(records, skip)
    med = summary["median_ms"]
    by_comm = {r.comm_type: r for r in rows}
    base = comm_types[0]
    speedup = None
    link_text = "loopback, no slow link" if mode == "loopback" else (
        f"cross-node link {measured_cross * 8 / 1e6:.0f} Mbit/s measured" if measured_cross
        else "emulated cluster")
    say(f"\nResult ({cfg.config_name} {cfg.run_name}, {link_text}):")
    say(f"  {'comm':6} {'median ms/iter':>14}  {'vs ' + base:>8}")
    for comm in comm_types:
        row = by_comm.get(comm)
        ms = row.median_ms if row and row.median_ms is not None else med[comm]
        ref = by_comm[base].median_ms if base in by_comm and by_comm[base].median_ms else med[base]
        ratio = ref / ms
        if comm != base:
            speedup = ratio
        say(f"  {comm:6} {ms:14.1f}  {ratio:7.2f}x")
    if speedup is not None:
        # speedup = base median / this median: > 1 means fewer ms per iteration than the base.
        if abs(speedup - 1) < 0.005:
            verdict = f"{comm_types[-1]} is as fast as {base}"
        else:
            verdict = (f"{comm_types[-1]} is {speedup:.2f}x faster than {base}" if speedup > 1
                       else f"{comm_types[-1]} is {1 / speedup:.2f}x slower than {base}")
        say(f"  {verdict} per iteration (median of iterations {skip + 1}-{v['train_iters']})"
            + ("" if mode == "netns" else "; loopback: no slow link, so no cross-node win to see"))
    agree = summary["loss_rel_diff"] <= tolerance
    say(f"  loss curves {'AGREE' if agree else 'DISAGREE'}: max |lm loss "
        f"{' - '.join(comm_types)}| = "
        f"{summary['loss_abs_diff']:.2e} (relative {summary['loss_rel_diff']:.2e}, tolerance "
        f"{tolerance:g}) over {v['train_iters']} iterations; final lm loss "
        + ", ".join(f"{c} {records[c][-1]['lm_loss']:.6f}" for c in comm_types))
    if not agree:
        rc = 1
    return DemoResult(rc, mode, log_paths, {c: med[c] for c in comm_types}, speedup,
                      summary["loss_abs_diff"], summary["loss_rel_diff"], records)


def _spec(cfg: Any, v: dict[str, Any], comm_types: Sequence[str], log_paths: dict[str, Path],
          topology: str, warmup: int) -> Any:
    return TrainSpec(config_name=cfg.config_name, run_name=cfg.run_name, values=v,
                     comm_types=tuple(comm_types),
                     log_paths={c: str(p) for c, p in log_paths.items()},
                     topology=topology, warmup_iters=warmup)


def _prepare_dirs(cfg: Any, comm_types: Sequence[str], log_paths: dict[str, Path],
                  meta: dict[str, Any]) -> None:
    """Create the run directories and their ``meta.json``."""
    for comm in comm_types:
        d = log_paths[comm].parent
        d.mkdir(parents=True, exist_ok=True)
        _write_meta(cfg, comm, d / "meta.json", meta)


def main(args: argparse.Namespace) -> int:
    """Run the demo from parsed :func:`add_arguments` options; the exit status."""
    try:
        result = run_demo(config=args.config, run=args.run,
                          overrides=_parse_overrides(args.overrides), out=args.out,
                          link=args.link, cross_rate=args.cross_rate,
                          intra_rate=args.intra_rate, nic=args.nic, skip=args.skip,
                          tolerance=args.tolerance, timeout_s=args.timeout_s)
    except (ConfigError, ValueError) as exc:
        print(f"charm-megatron demo: {exc}", file=sys.stderr)
        return 2
    except RankFailure as exc:
        print(f"charm-megatron demo: training failed:\n{exc}", file=sys.stderr)
        return 1
    return result.rc
