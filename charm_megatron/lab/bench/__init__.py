"""``charm-megatron bench``: the paper's operator benchmark (docs/bench.md).

One module per job:

* :mod:`~charm_megatron.lab.bench.config` - the grid (batch x sequence x heads), presets, parsing;
* :mod:`~charm_megatron.lab.bench.contenders` - what is timed: ``ring``, ``rmplus``, ``charm``
  (:func:`charm_megatron.cp_attention`) and PyTorch's own context-parallel ring (``torch``);
* :mod:`~charm_megatron.lab.bench.measure` - the per-rank timing loop (warm-up, alternating
  contenders, ablated runs for the CCR and the bound, peak memory);
* :mod:`~charm_megatron.lab.bench.links` - the software link model wired into gloo P2P (the
  fallback when network namespaces are unavailable);
* :mod:`~charm_megatron.lab.bench.runners` - where the ranks run: torchrun, local CPU processes, an
  emulated cluster (namespaces + tc) or the software link model;
* :mod:`~charm_megatron.lab.bench.analysis` - medians, spreads, speedups, CCR, the lower bound;
* :mod:`~charm_megatron.lab.bench.report` - CSV, JSON, the text table and the PNG plots;
* :mod:`~charm_megatron.lab.bench.progress` - the text progress bar;
* :mod:`~charm_megatron.lab.bench.cli` - the command line.

Importing this package imports neither torch nor matplotlib.
"""
