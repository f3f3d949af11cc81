#!/usr/bin/env python3
"""The paper's Table 5 beside the emulated runs: ``charm-megatron report table5 DIR``
(:mod:`charm_megatron.lab.reports.emulated`), kept under its old name.

    python scripts/table5_summary.py runs/emulated-t5      # or docs/performance/emulated-t5
"""

from __future__ import annotations

import sys

from charm_megatron.lab.reports.cli import main as report_main


def main(out: str) -> int:
    return report_main(["table5", out])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/emulated-t5"))
