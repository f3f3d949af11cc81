"""The tables the docs quote, each made by one ``charm-megatron report NAME`` command
(:mod:`.cli`), and the one typed reader of the benchmark CSV (:mod:`.bench_csv`).

A docs table made by a report sits in a generated block (``<!-- gen:report NAME ARGS -->`` ...
``<!-- gen:end -->``, :mod:`charm_megatron.lab.reports.docgen`) that says which command made it and
that tests/test_reports.py checks against a fresh run.
"""
