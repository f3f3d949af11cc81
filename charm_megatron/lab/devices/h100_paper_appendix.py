"""``h100-paper-appendix``: the paper's implementation on 2x8 H100, fitted to hold from small
to large per-rank sizes (issue 41): ``h100-paper-measured`` (Table 4's per-op cost, the kernel
measured on one H200, the cross rate fitted on Table 5's ring forward) with three terms fitted
on the *fit rows* of the paper's appendix Tables 9 and 10
(:data:`~charm_megatron.lab.calibration.appendix.FIT_SEQS`, both passes, ring and CHARM+):

* the per-op cost (starting from Table 4's);
* the intra-node rate a rank's messages reach (one rate per rank, no wider port: the paper's
  exchanges inside a node run far below NVLink's 365 GB/s per message);
* the compute slowdown while a *cross-node* transfer moves (``comm_slowdown_links="cross"``:
  the paper's intra copies are taken to hold no SMs).

Its merges run at the H100's memory bound (:func:`~charm_megatron.lab.calibration.paper.
merge_bound_gbps`, the fastest a merge can be): with the PyTorch-ops rate the fit lands
further from the fit rows (docs/model.md says by how much). The check rows and the paper's Table 5 4x8
rows are predictions the fit never saw."""

from __future__ import annotations

from dataclasses import replace

from charm_megatron.lab.calibration import appendix, paper
from charm_megatron.lab.calibration.calibrate import coordinate_descent
from charm_megatron.lab.calibration.refit import rnd
from charm_megatron.lab.devices.inputs import Inputs
from charm_megatron.model.cluster import Profile

#: The fields the appendix fit moves.
FIT_FIELDS = ("op_overhead_us", "intra_gbps", "comm_slowdown")


def start_cluster(built: dict[str, Profile]):
    """Where the fit starts: ``h100-paper-measured`` with one intra rate per rank, merges at
    the H100's memory bound and the slowdown counted on cross transfers only."""
    return replace(built["h100-paper-measured"].cluster, intra_port_gbps=None,
                   merge_gbps=paper.merge_bound_gbps("H100"), comm_slowdown_links="cross")


def recipe(built: dict[str, Profile], inputs: Inputs) -> Profile:
    base = built["h100-paper-measured"]
    rows = [r for r in appendix.load_rows() if r.fit]
    fitted, err = coordinate_descent(start_cluster(built), FIT_FIELDS,
                                     lambda c: appendix.fit_loss(c, rows), step=2.0,
                                     min_step=1.01, max_evals=300)
    cluster = replace(fitted, **{f: rnd(getattr(fitted, f)) for f in FIT_FIELDS})
    fit = {**base.fit,
           "method": base.fit["method"] + "; then op_overhead_us, intra_gbps and comm_slowdown "
                     "(cross transfers only) by the mean 4th power of the log errors of ring "
                     "time and CHARM+ speed-up on "
                     f"the appendix fit rows (S in {list(appendix.FIT_SEQS)}, "
                     f"{len(rows)} row-passes)",
           "inputs": {**base.fit["inputs"], "paper appendix Tables 9-10": "fit rows"},
           "fit_algos": ["ring", "charm"], "appendix_fit_seqs": list(appendix.FIT_SEQS),
           "appendix_loss": float(f"{err:.4g}"), "paper_mask": appendix.MASK}
    return Profile(
        "h100-paper-appendix", cluster, "2x8",
        f"the paper's implementation on 2x8 H100 at every per-rank size: h100-paper-measured "
        f"with {cluster.op_overhead_us:g} us per compute op, {cluster.intra_gbps:g} GB/s per "
        f"rank inside a node, compute +{cluster.comm_slowdown:.0%} while a cross transfer "
        f"moves and merges at the memory bound ({cluster.merge_gbps:g} GB/s), fitted on the "
        "appendix Tables 9-10 rows at S = "
        f"{', '.join(f'{s:,}' for s in appendix.FIT_SEQS)} (ring and CHARM+; the rows at the "
        "other lengths and Table 5's 4x8 rows unseen); rows modelled as causal attention in "
        "the contiguous layout", fit)
