"""Fitting the performance model and checking it: profiles fitted to bench output
(:mod:`.calibrate`) and to the paper's tables (:mod:`.refit`, :mod:`.paper`), the measured points
(:mod:`.measured`), the CPU testbed's cluster (:mod:`.testbed`), prediction against measurement
(:mod:`.accuracy`) and the ``charm-megatron model`` command (:mod:`.cli`). Lab code: nothing in
the runtime imports it."""
