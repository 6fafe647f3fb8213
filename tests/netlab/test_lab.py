"""The lab itself: its refusals and cleanup (a fake ``ip`` where they need none), then a real 2-node lab at 200 Mbit/s
across which a 2-rank ``ddp_scratch`` fit equals the same fit on loopback and a 32 MiB all-reduce takes bytes/rate.

The real-lab tests need root and ``ip``/``tc`` (CI runs as root on this machine kind); elsewhere they skip, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from lightning_zero.comm.link_model import resolve_link_model
from lightning_zero.netlab import lab
from lightning_zero.netlab.lab import LabError, NetLab, cleanup
from lightning_zero.netlab.probe import COLLECTIVES, sizes
from lightning_zero.netlab.topology import PREFIX, LabPlan
from tests.helpers.netlab import lab_objects, needs_root, run_netlab

JOB = Path(__file__).with_name("lab_job.py")
RATE = 200e6  # bit/s: slow enough that 32 MiB takes over a second, whatever the CPUs do


class FakeIp:
    """Records the commands; ``ip netns list`` answers ``existing``; the command at ``fail_at`` fails."""

    def __init__(self, existing: Sequence[str] = (), fail_at: int | None = None) -> None:
        self.existing, self.fail_at, self.commands = list(existing), fail_at, []

    def __call__(self, command: Sequence[str]) -> str:
        command = list(command)
        self.commands.append(command)
        if command[:3] == ["ip", "netns", "list"]:
            return "".join(f"{name} (id: {i})\n" for i, name in enumerate(self.existing))
        if command[:3] == ["ip", "netns", "pids"]:
            return ""
        if (
            self.fail_at is not None
            and len([c for c in self.commands if c[:3] != ["ip", "netns", "list"]]) == self.fail_at
        ):
            raise LabError(f"`{' '.join(command)}` failed (2): RTNETLINK answers: Operation not permitted")
        if command[:3] == ["ip", "netns", "add"]:
            self.existing.append(command[3])
        if command[:3] == ["ip", "netns", "delete"]:
            self.existing.remove(command[3])
        return ""


@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(lab, "ETC_NETNS", tmp_path / "etc-netns")


def test_not_root_is_refused_before_anything_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    ip = FakeIp()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(LabError, match=r"needs root .* run it as root"), NetLab(LabPlan(nodes=2), runner=ip):
        pass
    assert ip.commands == []


def test_missing_tools_are_named(monkeypatch: pytest.MonkeyPatch, as_root: None) -> None:
    monkeypatch.setattr(shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    ip = FakeIp()
    with (
        pytest.raises(LabError, match=r"needs `ip` and `tc` from iproute2: not found: tc$"),
        NetLab(LabPlan(nodes=2), runner=ip),
    ):
        pass
    assert ip.commands == []


def test_a_taken_name_is_refused_and_left_alone(as_root: None) -> None:
    ip = FakeIp(existing=["lzlab-n1", "other"])
    with (
        pytest.raises(LabError, match=r"namespace lzlab-n1 already exists: .* --cleanup removes it"),
        NetLab(LabPlan(nodes=2), runner=ip),
    ):
        pass
    assert ip.commands == [["ip", "netns", "list"]] and ip.existing == ["lzlab-n1", "other"]


@pytest.mark.parametrize("fail_at", [1, 4, 9, 12])
def test_a_failed_build_removes_what_it_made(as_root: None, fail_at: int) -> None:
    ip = FakeIp(existing=["other"], fail_at=fail_at)
    with pytest.raises(LabError, match="Operation not permitted"), NetLab(LabPlan(nodes=2, inter_node=1e9), runner=ip):
        pass
    assert ip.existing == ["other"]
    assert not list(lab.ETC_NETNS.glob(f"{PREFIX}-*"))


def test_the_lab_is_removed_when_its_block_raises(as_root: None) -> None:
    ip = FakeIp()
    with pytest.raises(KeyboardInterrupt), NetLab(LabPlan(nodes=3), runner=ip) as made:
        assert ip.existing == made.plan.namespaces
        assert (lab.ETC_NETNS / "lzlab-n2" / "hosts").read_text() == made.plan.hosts_file()
        raise KeyboardInterrupt
    assert ip.existing == [] and not list(lab.ETC_NETNS.iterdir())
    deletes = [c[3] for c in ip.commands if c[:3] == ["ip", "netns", "delete"]]
    assert deletes == ["lzlab-n2", "lzlab-n1", "lzlab-n0", "lzlab-hub"]  # nodes first, the hub last


def test_cleanup_removes_only_the_labs_names(as_root: None) -> None:
    ip = FakeIp(existing=["lzlab-hub", "lzlab-n0", "lzlabx", "mine"])
    assert cleanup(ip) == ["lzlab-hub", "lzlab-n0"]
    assert ip.existing == ["lzlabx", "mine"]


# ------------------------------------------------------------------------------------------------------ real labs
def _loopback_job(mode: str, out: Path, port: int) -> None:
    """The same 2-node job with both nodes' torchruns on this machine's loopback."""
    base = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--master-addr=127.0.0.1",
    ]
    job = [f"--master-port={port}", str(JOB), mode, str(out)]
    nodes = [subprocess.Popen([*base, f"--node-rank={k}", *job], stderr=subprocess.PIPE, text=True) for k in range(2)]
    for node in nodes:
        _, err = node.communicate(timeout=240)
        assert node.returncode == 0, err[-3000:]


@pytest.mark.slow  # 70 s each: the default run keeps the lab's refusals and its exit-code test
@needs_root
def test_a_fit_across_the_lab_equals_the_fit_on_loopback_and_bytes_take_bytes_over_rate(
    tmp_path: Path, no_lab_left: None
) -> None:
    lab_fit, loop_fit, timing = tmp_path / "lab.pt", tmp_path / "loop.pt", tmp_path / "allreduce.json"
    done = run_netlab("--nodes", "2", "--inter-node", "200mbit", "--", sys.executable, str(JOB), "fit", str(lab_fit))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "inter-node 200Mbit on lzlab0 (each node's egress): tbf burst 25000 bytes (MTU 1500)" in done.stdout
    done = run_netlab(
        "--nodes", "2", "--inter-node", "200mbit", "--", sys.executable, str(JOB), "allreduce", str(timing)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert lab_objects() == []
    _loopback_job("fit", loop_fit, port=29631)

    across, local = torch.load(lab_fit), torch.load(loop_fit)
    assert across.keys() == local.keys()
    for name in across:
        assert torch.equal(across[name], local[name]), name
    # 2 ranks: gloo's ring all-reduce sends each rank's (N-1)/N of the tensor twice (reduce-scatter, all-gather).
    measured = json.loads(timing.read_text())
    on_the_wire = 2 * (2 - 1) / 2 * measured["bytes"]
    expected = on_the_wire * 8 / RATE
    assert abs(measured["median_s"] / expected - 1) <= 0.15, (measured, expected)


@needs_root
def test_a_failing_command_returns_its_exit_code_and_leaves_nothing(tmp_path: Path, no_lab_left: None) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    done = run_netlab("--nodes", "2", "--inter-node", "1gbit", "--", sys.executable, str(script), timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]  # the rank's own code, not torchrun's 1
    assert lab_objects() == []


@needs_root
def test_refusals_leave_no_lab_object(no_lab_left: None) -> None:
    done = run_netlab("--inter-node", "1gbps", "--", "true")
    assert done.returncode == 2 and "--inter-node='1gbps' is invalid: expected a number and a unit" in done.stderr
    subprocess.run(["ip", "netns", "add", "lzlab-n1"], check=True)
    try:
        done = run_netlab("--nodes", "2", "--", "true")
        assert done.returncode == 2 and "lzlab-n1 already exists" in done.stderr
        assert lab_objects() == ["lzlab-n1"]  # the taken name stays; nothing else was made
    finally:
        done = run_netlab("--cleanup")
    assert done.returncode == 0 and "removed lzlab-n1" in done.stdout
    assert lab_objects() == []


@pytest.mark.slow  # 70 s each: the default run keeps the lab's refusals and its exit-code test
@needs_root
def test_check_measures_each_link_and_fits_each_collective(tmp_path: Path, no_lab_left: None) -> None:
    out = tmp_path / "check.json"
    done = run_netlab(
        "--nodes", "2", "--inter-node", "200mbit", "--check", "--check-max-size", "1MiB", "--json", str(out)
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert [(link["src"], link["dst"]) for link in results["links"]] == [(0, 1), (1, 0)]
    for link in results["links"]:  # the line rate less TCP/IP and Ethernet headers (about 4.5% of 1514-byte frames)
        assert 0.85 <= link["rate_bps"] / RATE <= 1.0, link
    assert list(results["collectives"]) == list(COLLECTIVES)
    assert list(results["levels"]) == ["inter_node"]  # one rank per node: no level inside a node, no hierarchy
    for name, model in {**results["collectives"], **results["levels"]}.items():
        assert [b for b, _ in model["points"]] == sizes(1 << 20), name
        assert model["alpha_s"] >= 0 and model["beta_s_per_byte"] > 0, name
        assert f"| {name} |" in done.stdout or name == "inter_node"
    assert "| all_reduce across nodes (leaders) (2 ranks) |" in done.stdout
    model = resolve_link_model(str(out))  # the file is a ddp_scratch link_model setting
    assert model is not None and model.intra_node is None and model.inter_node.beta_s_per_byte > 0
    assert lab_objects() == []
