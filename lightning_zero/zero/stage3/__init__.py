"""ZeRO stage 3: parameters sharded and gathered per unit (the engine and its unit hooks, gathers, gradient
reductions and accumulation windows; units, segments, gather order, state dicts, model construction)."""
