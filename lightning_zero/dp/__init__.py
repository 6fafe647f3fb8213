"""Data parallelism: the bucketed gradient reducer, unused-parameter handling and gradient norms over shards."""
