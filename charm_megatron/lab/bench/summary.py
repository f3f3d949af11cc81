"""Several benchmark runs side by side, as a Markdown table: ``charm-megatron report summary``
(:mod:`charm_megatron.lab.reports.summary`), kept here under its old name.

``python -m charm_megatron.lab.bench.summary runs/performance/*/results.csv [--passes fwd,fwdbwd]``
is ``charm-megatron report summary`` with the same arguments.
"""

from __future__ import annotations

import sys

from charm_megatron.lab.reports.summary import auto_lines, load, make, table

__all__ = ["auto_lines", "load", "main", "make", "table"]


def main(argv: list[str] | None = None) -> int:
    from charm_megatron.lab.reports.cli import main as report_main

    return report_main(["summary", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
