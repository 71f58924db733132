"""Backend placement (Collage, paper §4 / thesis §2.4): which backend runs which operators.

- :mod:`.candidates`: candidate groups from the backends' patterns and pattern rules;
- :mod:`.costs`: their measured costs ``M(P(g))`` and the context switch ``ε`` by tensor size;
- :mod:`.dp`: the op-level dynamic program (Algorithm 1);
- :mod:`.evolution`: the graph-level evolutionary search (§4.3);
- :mod:`.plan`: :func:`plan_placement`, the whole search producing a ``PlacementPlan``.
"""

from tessera.planners.placement.plan import PlacementOptions, PlacementResult, plan_placement

__all__ = ["PlacementOptions", "PlacementResult", "plan_placement"]
