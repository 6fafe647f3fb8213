"""Optimizers that train the same under ``ddp`` and every ZeRO stage although their step is not elementwise.

- :class:`SAM`: sharpness-aware minimisation, with its global gradient norm taken across the shards.
- :class:`ShardAware` / :class:`Sharding`: the protocol the ZeRO engines use to hand such an optimizer what it needs
  (see [Note: shard-aware optimizers] in ``lightning_zero/optim/sharding.py``).
"""

from lightning_zero.optim.sam import SAM
from lightning_zero.optim.sharding import ShardAware, Sharding

__all__ = ["SAM", "ShardAware", "Sharding"]
