"""ZeRO stage 3: parameters sharded and gathered per unit (engine, units, segments, gather order, state
dicts, model construction)."""
