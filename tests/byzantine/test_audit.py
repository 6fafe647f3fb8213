"""``lightning_zero/byzantine/audit.py``: the state digest, and what :func:`summarize` makes of a run's audit files
(synthetic ones here; ``tests/strategies/test_robust_byzantine.py`` audits real fits)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_zero.byzantine.audit import state_digest, summarize


def test_the_digest_sees_every_bit_of_parameters_and_buffers_and_nothing_else():
    torch.manual_seed(0)
    a = nn.BatchNorm1d(3)
    a.weight.data.normal_()
    b = nn.BatchNorm1d(3)
    b.load_state_dict(a.state_dict())
    assert state_digest(a) == state_digest(b)
    b.running_mean[1] = torch.nextafter(b.running_mean[1], torch.tensor(1.0))  # one ulp of one buffer
    assert state_digest(a) != state_digest(b)
    b.load_state_dict(a.state_dict())
    b.weight.data[0] = torch.nextafter(a.weight[0], torch.tensor(float("inf")))  # one ulp of one parameter
    assert state_digest(a) != state_digest(b)


def _audit(rank: int, digests: list[str], evictions: tuple[list, ...] | list[list] = ()) -> dict:
    return {"rank": rank, "digests": digests, "evictions": [list(e) for e in evictions], "members": None}


def test_summarize_checks_safety_at_every_step_and_names_the_first_divergence():
    same = {r: _audit(r, ["a", "b", "c"]) for r in range(4)}
    ok = summarize(same, faulty=[3], world_size=4)
    assert ok["safe"] and ok["steps"] == 3 and ok["first_divergence"] is None and ok["missing"] == []
    diverged = {**same, 1: _audit(1, ["a", "x", "c"]), 3: _audit(3, ["z", "z", "z"])}  # the faulty rank may differ
    bad = summarize(diverged, faulty=[3], world_size=4)
    assert not bad["safe"] and bad["first_divergence"] == 1
    missing = summarize({r: same[r] for r in (0, 2, 3)}, faulty=[3], world_size=4)
    assert not missing["safe"] and missing["missing"] == [1]
    short = summarize({**same, 2: _audit(2, ["a", "b"])}, faulty=[3], world_size=4)
    assert not short["safe"] and short["steps"] == [2, 3]


def test_summarize_reports_evictions_of_honest_and_faulty_ranks():
    evicted = {r: _audit(r, ["a"], [[1, 3, "proof: equivocation"]]) for r in range(3)}
    out = summarize({**evicted, 3: _audit(3, ["a"])}, faulty=[3], world_size=4)
    assert out["honest_evicted"] == [] and out["faulty_evicted"] == {3: 1} and out["evicted_by_all"] == {3: True}
    split = {**evicted, 2: _audit(2, ["a"], [[2, 3, "left out"], [2, 1, "left out"]])}
    out = summarize(split, faulty=[3], world_size=4)
    assert out["honest_evicted"] == [1] and out["faulty_evicted"] == {3: 1} and out["evicted_by_all"] == {3: False}
    never = summarize({r: _audit(r, ["a"]) for r in range(7)}, faulty=[5, 6], world_size=7)
    assert never["faulty_evicted"] == {5: None, 6: None} and never["evicted_by_all"] == {5: False, 6: False}
