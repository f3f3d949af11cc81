"""``charm-megatron report appendix``: the paper's appendix Tables 9 and 10 (2x8 H100, batch
1-128, sequence 3,360-215,040) against a profile's predictions, row by row, with the speed-up
error on the rows a fit may use and on the rest (:mod:`charm_megatron.lab.calibration.appendix`).
"""

from __future__ import annotations

import argparse

from charm_megatron.lab.calibration import accuracy, appendix
from charm_megatron.model import get_profile

DEFAULT_PROFILE = "h100-paper-appendix"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default=DEFAULT_PROFILE,
                        help=f"the device profile (default {DEFAULT_PROFILE}, the one fitted "
                             "on the fit rows)")
    parser.add_argument("--summary", action="store_true", help="only the summary table")


def text(profile: str = DEFAULT_PROFILE, *, detail: bool = True) -> str:
    """The report's Markdown: the summary and (``detail``) every row-pass."""
    prof = get_profile(profile)
    fitted = "appendix_fit_seqs" in prof.fit
    sts = appendix.settings(prof.cluster, fitted_on_charm=fitted)
    if not fitted:  # a profile that never saw the rows: nothing of them is calibrated on
        sts = [accuracy.Setting(st.group.replace(" fit rows", " rows a fit may use"), st.label,
                                st.measured, st.predicted, frozenset()) for st in sts]
    out = [f"Profile `{prof.name}`: `{prof.cluster.describe()}`; rows modelled as "
           f"{appendix.MASK}, partials in fp32. `*`: a time the profile was fitted on.", "",
           appendix.summary(sts)]
    if detail:
        out += ["", accuracy.detail_table(sts)]
    return "\n".join(out) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        print(text(args.profile, detail=not args.summary), end="")
    except ValueError as exc:
        raise SystemExit(f"charm-megatron report appendix: {exc}") from None
    return 0
