"""``python -m charm_megatron.lab.emulate``: check, clean up, or run a command inside a namespace.

* ``check [--groups 2 --ranks 4 --cross-rate 1gbit --intra-rate R --nic node|rank
  --link-model tbf|htb --cross-burst B --intra-burst B --ingress|--no-ingress]``: build a
  cluster, print its layout and the measured rates, remove it.
* ``cleanup [--all]``: remove namespaces left by killed runs (``--all``: every ``cmemu-`` one,
  also of live processes).
* ``exec --netns NAME [--hostname H] [--env K=V ...] -- CMD ...``: run CMD in that namespace
  (what :meth:`EmulatedCluster.command` builds for subprocess launchers).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from charm_megatron.lab.emulate import netns
from charm_megatron.lab.emulate.cluster import LINK_MODELS, NIC_MODELS, EmulatedCluster


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m charm_megatron.lab.emulate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="build a cluster, measure it, remove it")
    chk.add_argument("--groups", type=int, default=2)
    chk.add_argument("--ranks", type=int, default=4, help="ranks per group (node)")
    chk.add_argument("--cross-rate", default="1gbit")
    chk.add_argument("--intra-rate", default=None)
    chk.add_argument("--nic", choices=NIC_MODELS, default="node")
    chk.add_argument("--link-model", choices=LINK_MODELS, default="tbf",
                     help="htb: one veth per rank, classes by peer node (needs --nic rank)")
    chk.add_argument("--cross-burst", default=None, help="cross shaper bucket (e.g. 512kb)")
    chk.add_argument("--intra-burst", default=None, help="intra shaper bucket (e.g. 4mb)")
    chk.add_argument("--ingress", action=argparse.BooleanOptionalAction, default=None,
                     help="also shape traffic into each rank (default: tbf yes, htb no)")
    chk.add_argument("--seconds", type=float, default=0.5)
    cln = sub.add_parser("cleanup", help="remove namespaces left behind")
    cln.add_argument("--all", action="store_true", help="also those of live processes")
    ex = sub.add_parser("exec", help="run a command inside a namespace")
    ex.add_argument("--netns", required=True)
    ex.add_argument("--hostname", default=None)
    ex.add_argument("--env", action="append", default=[], metavar="K=V")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.cmd == "exec":
        cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        if not cmd:
            parser.error("exec needs a command after --")
        netns.setns(netns.netns_path(args.netns), netns.CLONE_NEWNET)
        if args.hostname:
            netns.unshare(netns.CLONE_NEWUTS)
            socket.sethostname(args.hostname)
        for kv in args.env:
            k, _, v = kv.partition("=")
            os.environ[k] = v
        os.execvp(cmd[0], cmd)
    if args.cmd == "cleanup":
        if args.all:
            names = [n for n in netns.list_netns() if n.startswith(netns.PREFIX)]
            for n in names:
                netns.run_ip(["netns", "del", n], check=False)
        else:
            names = netns.cleanup_stale()
        print(f"removed {len(names)} namespace(s)" + (": " + " ".join(names) if names else ""))
        return 0
    ok, why = netns.available()
    if not ok:
        print(f"network-namespace emulation not available: {why}")
        return 1

    if args.link_model == "htb" and args.nic != "rank":
        parser.error("--link-model htb needs --nic rank (one NIC per rank carries both kinds "
                     "of traffic)")
    with EmulatedCluster(args.groups, args.ranks, args.cross_rate, args.intra_rate, args.nic,
                         cross_burst=args.cross_burst, intra_burst=args.intra_burst,
                         link_model=args.link_model, ingress=args.ingress) as c:
        print(c.describe())
        print(c.measure_rates(args.seconds, concurrent=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
