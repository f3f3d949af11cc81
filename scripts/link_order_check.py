#!/usr/bin/env python3
"""Emulated GPU-cluster runs against the model with either link order: ``charm-megatron report
link-order CSV...`` (:mod:`charm_megatron.lab.reports.link_order`), kept under its old name.

    python scripts/link_order_check.py docs/performance/emulated-t5/paper-measured/*.csv
"""

from __future__ import annotations

import sys

from charm_megatron.lab.reports.cli import main as report_main


def main(paths: list[str]) -> int:
    return report_main(["link-order", *paths])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
