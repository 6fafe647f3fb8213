"""What the real-lab tests share: whether this machine can build a lab, the CLI as a subprocess, and what is left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_zero.netlab.topology import PREFIX


def why_no_lab() -> str | None:
    """Why this process cannot build a lab (``None``: it can)."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "the lab needs root on Linux (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"the lab needs iproute2: not found: {', '.join(missing)}" if missing else None


needs_root = pytest.mark.skipif(why_no_lab() is not None, reason=why_no_lab() or "")


def run_netlab(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``lightning-zero-netlab ARGS`` in a subprocess (its signal handlers stay out of pytest's process)."""
    command = [sys.executable, "-m", "lightning_zero.netlab.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False)


def lab_objects() -> list[str]:
    """The lab's namespaces and ``/etc/netns`` files on this machine."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listed.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}-")] + [p.name for p in Path("/etc/netns").glob(f"{PREFIX}-*")]
