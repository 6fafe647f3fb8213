"""The Hydra config tree of the repository (``conf/``, shipped as ``lightning_zero.conf``), for tests."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"


def options(group: str) -> list[str]:
    """The options of config group ``group``: the names of ``conf/<group>/*.yaml``."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
