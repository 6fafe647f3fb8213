"""Pipeline schedules as pure data: which micro-batch each stage runs forward or backward, in what order.

A pipeline splits the model's layers into ``stages`` (one per rank) and each batch into ``micro_batches``. Stage
``s`` can run the forward of micro-batch ``m`` once stage ``s - 1`` has sent it its activation, and the backward of
``m`` once stage ``s + 1`` has sent back the activation's gradient (the last stage: right after its own forward,
where the loss is). A *schedule* is the order in which each stage runs its ``2 * micro_batches`` actions; the
dependencies above then fix when each can start. Two schedules, naive beside real:

- **GPipe** (fill-drain, Huang et al. 2019): every forward, then every backward (in reverse). Simple; each stage keeps
  the activations of all ``micro_batches`` until its first backward.
- **1F1B** (PipeDream-Flush, Narayanan et al. 2021): stage ``s`` runs ``stages - 1 - s`` warm-up forwards, then
  alternates one forward and one backward, then drains the backwards. Same bubble as GPipe when every forward (and
  every backward) takes as long, but a stage holds at most ``stages - s`` micro-batches' activations, not
  ``micro_batches``.

With forward time ``f`` and backward time ``b`` on every stage, both take ``(micro_batches + stages - 1) * (f + b)``
and leave each stage idle for the *bubble fraction* ``(stages - 1) / (micro_batches + stages - 1)`` of it.
:func:`simulate` replays a schedule under those dependencies (an event-free list scheduling, pure), so the bubble and
the peak activations of any schedule are measured from the schedule itself rather than assumed; the tests hold both
schedules to the formulas, and the runtime will hold its measured timeline to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

SCHEDULES = ("gpipe", "1f1b")


class Action(NamedTuple):
    """One step of a stage: ``"F"`` (forward) or ``"B"`` (backward) of micro-batch ``micro_batch``."""

    kind: Literal["F", "B"]
    micro_batch: int


def check_pipeline(stages: int, micro_batches: int) -> None:
    """Refuse sizes a pipeline cannot have, naming the value."""
    for name, value in (("stages", stages), ("micro_batches", micro_batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")


def gpipe(stages: int, micro_batches: int) -> list[list[Action]]:
    """Fill-drain: per stage, every forward in order, then every backward in reverse order."""
    check_pipeline(stages, micro_batches)
    forwards = [Action("F", m) for m in range(micro_batches)]
    backwards = [Action("B", m) for m in reversed(range(micro_batches))]
    return [forwards + backwards for _ in range(stages)]


def one_f_one_b(stages: int, micro_batches: int) -> list[list[Action]]:
    """1F1B: ``stages - 1 - s`` warm-up forwards on stage ``s``, then one forward and one backward in turn, then the
    remaining backwards; micro-batches go forward and backward in order."""
    check_pipeline(stages, micro_batches)
    out = []
    for s in range(stages):
        warmup = min(stages - 1 - s, micro_batches)
        actions = [Action("F", m) for m in range(warmup)]
        next_forward, next_backward = warmup, 0
        while next_forward < micro_batches:
            actions += [Action("F", next_forward), Action("B", next_backward)]
            next_forward, next_backward = next_forward + 1, next_backward + 1
        actions += [Action("B", m) for m in range(next_backward, micro_batches)]
        out.append(actions)
    return out


def build(name: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """The schedule called ``name`` (one of :data:`SCHEDULES`)."""
    if name == "gpipe":
        return gpipe(stages, micro_batches)
    if name == "1f1b":
        return one_f_one_b(stages, micro_batches)
    raise ValueError(f"schedule={name!r} is invalid: expected one of {SCHEDULES}")


@dataclass(frozen=True)
class Timeline:
    """What :func:`simulate` measured: the start time of every action (``start[s][i]`` for stage ``s``'s ``i``-th
    action), the makespan, each stage's idle fraction, and the most micro-batches whose activations a stage held
    at once (forwards done whose backward is not)."""

    start: list[list[float]]
    makespan: float
    bubble: list[float]
    peak_activations: list[int]


def simulate(schedule: list[list[Action]], forward: float = 1.0, backward: float = 2.0) -> Timeline:
    """Replay ``schedule`` with every forward taking ``forward`` and every backward ``backward``: each stage runs its
    actions in order, each as soon as the stage is free and its inputs have arrived (no transfer time). Raises
    ``ValueError`` for a schedule that is incomplete or deadlocks (a stage waits for an action that never comes)."""
    stages = len(schedule)
    micro_batches = sum(a.kind == "F" for a in schedule[0]) if schedule else 0
    for s, actions in enumerate(schedule):
        expected = sorted([("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)])
        if sorted(actions) != expected:
            raise ValueError(f"stage {s} does not run each of the {micro_batches} forwards and backwards once")
    end: dict[tuple[int, str, int], float] = {}
    start = [[0.0] * len(actions) for actions in schedule]
    position, free = [0] * stages, [0.0] * stages
    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(schedule[s]):
                kind, m = schedule[s][position[s]]
                needs = [(s - 1, "F", m)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [(s, "F", m)] + ([(s + 1, "B", m)] if s < stages - 1 else [])
                if any(need not in end for need in needs):
                    break
                begin = max([free[s], *(end[need] for need in needs)])
                start[s][position[s]] = begin
                free[s] = end[(s, kind, m)] = begin + (forward if kind == "F" else backward)
                position[s], remaining, progressed = position[s] + 1, remaining - 1, True
        if not progressed:
            stuck = {s: schedule[s][position[s]] for s in range(stages) if position[s] < len(schedule[s])}
            raise ValueError(f"the schedule deadlocks: stages wait for each other at {stuck}")
    makespan = max(free) if stages else 0.0
    busy = micro_batches * (forward + backward)
    bubble = [1.0 - busy / makespan if makespan else 0.0 for _ in range(stages)]
    peak = []
    for actions in schedule:
        held = most = 0
        for kind, _ in actions:
            held += 1 if kind == "F" else -1
            most = max(most, held)
        peak.append(most)
    return Timeline(start=start, makespan=makespan, bubble=bubble, peak_activations=peak)


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """The idle fraction of every stage under GPipe and 1F1B: ``(stages - 1) / (micro_batches + stages - 1)``."""
    check_pipeline(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)
