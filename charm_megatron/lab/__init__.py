"""Benchmarks, emulation, calibration and the reports the docs quote: nothing the runtime imports."""
