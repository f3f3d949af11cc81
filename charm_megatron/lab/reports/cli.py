"""``charm-megatron report NAME ...``: the tables the docs quote, one subcommand each.

Each report prints Markdown on stdout. The CSV reports read bench CSVs through
:mod:`charm_megatron.lab.reports.bench_csv`; ``memory`` measures; ``docgen`` rewrites the
generated blocks of a docs page (those of ``<!-- gen:report ... -->`` run these reports).
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, register function, run function, one-line help)
REPORTS: dict[str, tuple[str, str, str, str]] = {
    "summary": ("charm_megatron.lab.reports.summary", "register", "run",
                "bench runs side by side: every algorithm's ms, speed-up, /bound, ceiling"),
    "peers": ("charm_megatron.lab.reports.peers", "register", "run",
              "every contender per point (one CSV each): ms (bound) speed-up, fastest, auto"),
    "table5": ("charm_megatron.lab.reports.emulated", "register_table5", "run_table5",
               "the paper's Table 5 beside the emulated H100 runs"),
    "table4": ("charm_megatron.lab.reports.emulated", "register_table4", "run_table4",
               "the paper's Table 4 beside the emulated L20 / H20 runs"),
    "llama": ("charm_megatron.lab.reports.emulated", "register_llama", "run_llama",
              "ring / RM+ / CHARM+ per point and pass on an emulated cluster"),
    "link-order": ("charm_megatron.lab.reports.link_order", "register", "run",
                   "emulated runs against the model with fair and fifo links"),
    "bound-gap": ("charm_megatron.lab.reports.bound_gap", "register", "run",
                  "where CHARM+'s modelled time above its lower bound goes, cost by cost"),
    "head-parallel": ("charm_megatron.lab.reports.head_parallel", "register", "run",
                      "CHARM+ with head parallelism against a2a+p2p and its bound, by the model"),
    "te": ("charm_megatron.lab.reports.te_shipped", "register", "run",
           "our auto against TransformerEngine's CP types as shipped, by the model"),
    "appendix": ("charm_megatron.lab.reports.appendix", "register", "run",
                 "the paper's appendix Tables 9-10 (2x8, small to large sizes) against a profile"),
    "memory": ("charm_megatron.lab.reports.memory", "register", "run",
               "measure peak memory of ring / RM+ / CHARM+ on local gloo ranks"),
    "docgen": ("charm_megatron.lab.reports.docgen", "register", "run",
               "rewrite (or --check) the generated blocks of a docs page"),
}


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="report", metavar="NAME", required=True)
    for name, (module, reg, _, help_text) in REPORTS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(importlib.import_module(module), reg)(p)


def run(args: argparse.Namespace) -> int:
    module, _, fn, _ = REPORTS[args.report]
    return int(getattr(importlib.import_module(module), fn)(args) or 0)


def main(argv: list[str]) -> int:
    """``charm-megatron report`` with ``argv`` (what the old script names call)."""
    from charm_megatron.cli import main as cli_main

    return cli_main(["report", *argv])
