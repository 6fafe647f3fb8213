"""Hydra configs of lightning_zero, shipped as the package ``lightning_zero.conf`` (``pkg://lightning_zero.conf``).

Importing this package stores the typed strategy schemas in Hydra's ConfigStore, so the configs compose from
``hydra.initialize_config_module("lightning_zero.conf")`` as well as from ``lightning-zero-train``. Other
applications reuse the groups with ``hydra.searchpath: [pkg://lightning_zero.conf]``.
"""

from lightning_zero.tools.config_schema import register_configs

register_configs()
