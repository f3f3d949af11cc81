"""The built-in CP attention algorithms, each a registry entry (plan/entries.Algorithm) in its
own module: :mod:`.ring`, :mod:`.charm` (RM+ and CHARM+), :mod:`.allgather`, :mod:`.ulysses`.

:data:`BUILTINS` is the registry's order of them (what ``--cp-comm-type`` lists and ``auto``
breaks ties by); :mod:`charm_megatron.plan.registry` registers them in one loop. Adding one:
write its module, add its entry here (tests/toy_algorithm.py registers one from outside).
"""

from __future__ import annotations

from charm_megatron.algorithms.allgather import ALLGATHER
from charm_megatron.algorithms.charm.entry import CHARM, RMPLUS
from charm_megatron.algorithms.ring import RING
from charm_megatron.algorithms.ulysses import A2A, A2A_P2P

BUILTINS = (RING, RMPLUS, CHARM, ALLGATHER, A2A, A2A_P2P)

__all__ = ["BUILTINS"]
