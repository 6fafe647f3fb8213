"""One optimizer step of robust aggregation: attack simulation, non-finite filter, pre-aggregators, rule, metrics.

Runbook::

    agg = RobustAggregator("trimmed_mean", f=2, pre_aggregators=["nnm"])
    agg.validate(n=8)                      # the tolerance checks; raises ValueError with rule, n, f and the bound
    result = agg(stack)                    # stack: (n, d), one row per worker; result.vector: (d,)

The pipeline, in order (pure functions from :mod:`~lightning_zero.robust.aggregators`,
:mod:`~lightning_zero.robust.preaggregators`, :mod:`~lightning_zero.robust.attacks`):

1. *attack simulation* (evaluation only): the rows of ``byzantine`` workers are replaced by the attack's vectors,
   computed from the honest rows of this step (omniscient, as in the literature);
2. *non-finite filter*: rows holding NaN/Inf are dropped and ``f`` lowered by as many (skipped only for a bare
   ``mean``, the unprotected baseline);
3. *pre-aggregators*, in the order given (``nnm``, ``bucketing``, ``clip``);
4. the *rule*. ``centered_clipping`` starts from the previous step's result (its centre, kept in :meth:`state_dict`).

Given a :class:`~lightning_zero.robust.shards.ColumnShard`, the same pipeline aggregates only the shard's columns of
every worker's vector ([Note: sharded aggregation] in :mod:`lightning_zero.robust.shards`).

Every rank runs the same pipeline on the same gathered stack (randomness from one seeded generator that every rank
advances identically), so every rank computes the same aggregate.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_zero.robust.aggregators import RULES, check_rule
from lightning_zero.robust.attacks import ATTACKS, apply_attack, check_attack
from lightning_zero.robust.preaggregators import PRE_AGGREGATORS, check_pre_aggregator
from lightning_zero.robust.shards import ColumnShard
from lightning_zero.robust.stack import check_known, drop_nonfinite, sq_distance_to_mean, unfiltered

StageSpec = str | Mapping[str, Any]
"""A pre-aggregator: its name, or a mapping with ``name`` and its parameters (``{"name": "bucketing", "s": 2}``)."""


def parse_stage(spec: StageSpec) -> tuple[str, dict[str, Any]]:
    """``"nnm"`` or ``{"name": "clip", "c": 1.0}`` -> ``(name, kwargs)``."""
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, Mapping) and "name" in spec:
        kwargs = {str(k): v for k, v in spec.items() if k != "name"}
        return str(spec["name"]), kwargs
    raise ValueError(f"pre_aggregators entry {spec!r} is invalid: expected a name or a mapping with a 'name' key")


@dataclass
class AggregationResult:
    """The aggregate of one step and what it is logged with."""

    vector: Tensor
    honest_distance: float
    """L2 distance from ``vector`` to the mean of the honest rows (all rows when no attack is simulated)."""
    byzantine_selected: float | None
    """Share of Byzantine rows among the rows a selection rule (Krum, Multi-Krum, Bulyan) picked; ``None`` for other
    rules, or when a pre-aggregator (``bucketing``) mixes rows so that a pick is not one worker."""
    dropped: int
    """Rows dropped for holding NaN/Inf."""
    seconds: float
    """Time of steps 2-4 on this rank."""


class RobustAggregator:
    """A robust rule with its pre-aggregators, an optional simulated attack, and the rule's state.

    Args:
        rule: a name of :data:`~lightning_zero.robust.aggregators.RULES`.
        f: the number of Byzantine workers to tolerate; never lowered silently (see :meth:`validate`).
        rule_kwargs: the rule's parameters (``m`` of ``multi_krum``, ``nu``/``iterations`` of ``geometric_median``,
            ``tau``/``iterations`` of ``centered_clipping``).
        pre_aggregators: names or ``{"name": ..., **params}`` mappings, applied in order.
        attack: a name of :data:`~lightning_zero.robust.attacks.ATTACKS` to *simulate*, or ``None``.
        attack_kwargs: the attack's parameters.
        byzantine: global indices of the simulated Byzantine workers; default: the last ``f``.
        seed: seed of the generator behind ``bucketing`` and the ``gaussian`` attack.
    """

    def __init__(
        self,
        rule: str = "mean",
        f: int = 0,
        rule_kwargs: Mapping[str, Any] | None = None,
        pre_aggregators: Sequence[StageSpec] = (),
        attack: str | None = None,
        attack_kwargs: Mapping[str, Any] | None = None,
        byzantine: Sequence[int] | None = None,
        seed: int = 0,
    ) -> None:
        if isinstance(f, bool) or not isinstance(f, int) or f < 0:
            raise ValueError(f"f={f!r} is invalid: expected an integer >= 0")
        self.rule, self.f = rule, f
        self.rule_kwargs = dict(rule_kwargs or {})
        check_known("aggregator", rule, self.rule_kwargs, RULES)  # names now; bounds in validate(n)
        self.stages = [parse_stage(s) for s in pre_aggregators]
        for name, kwargs in self.stages:
            check_known("pre_aggregator", name, kwargs, PRE_AGGREGATORS)
        self.attack = attack
        self.attack_kwargs = dict(attack_kwargs or {})
        if attack is not None:
            check_known("attack", attack, self.attack_kwargs, ATTACKS)
        self._byzantine_arg = None if byzantine is None else [int(i) for i in byzantine]
        self.byzantine: list[int] = []
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.center: Tensor | None = None
        self.n: int | None = None

    @property
    def spec(self) -> Any:
        return RULES[self.rule]

    @property
    def filters_nonfinite(self) -> bool:
        """Everything but a bare ``mean`` drops NaN/Inf rows (the baseline shows what no protection does)."""
        return self.spec.robust or bool(self.stages)

    def validate(self, n: int) -> None:
        """Check the whole pipeline for ``n`` workers: each pre-aggregator at the ``(n, f)`` it sees, the rule at what
        the last one hands on (``bucketing`` checks the rule at ``ceil(n / s)``), and the simulated attack."""
        stage_n, stage_f = n, self.f
        for name, kwargs in self.stages:
            stage_n, stage_f = check_pre_aggregator(name, stage_n, stage_f, **kwargs)
        with warnings.catch_warnings():
            if self.attack is not None:  # a simulated attack on ``mean`` is the point of the baseline
                warnings.simplefilter("ignore")
            check_rule(self.rule, stage_n, stage_f, **self.rule_kwargs)
        if self.attack is not None:
            if self._byzantine_arg is None and self.f == 0:
                raise ValueError(f"attack={self.attack!r} needs byzantine_workers or f > 0 to choose its workers")
            self.byzantine = self._byzantine_arg if self._byzantine_arg is not None else list(range(n - self.f, n))
            check_attack(self.attack, n, self.byzantine, **self.attack_kwargs)
        self.n = n

    @property
    def data_attack(self) -> bool:
        """Whether the simulated attack acts on the data (``label_flip``) rather than on the gradients."""
        return self.attack is not None and ATTACKS[self.attack].data_level

    def __call__(self, stack: Tensor, shard: ColumnShard | None = None) -> AggregationResult:
        """Aggregate ``stack``, one row per worker: every column, or those of ``shard`` ([Note: sharded aggregation]
        in :mod:`lightning_zero.robust.shards`), whose totals then make distances, norms and the metrics global."""
        if stack.shape[0] != self.n:
            raise ValueError(f"got {stack.shape[0]} worker vectors, validated for n={self.n}: call validate(n) first")
        shard = shard if shard is not None else ColumnShard.whole(stack.shape[1])
        total = shard.total
        byzantine = set(self.byzantine)
        honest = [i for i in range(stack.shape[0]) if i not in byzantine]
        sent = stack  # what the workers sent: the honest rows, which the metric measures against
        if self.attack is not None and not self.data_attack:
            stack = apply_attack(
                self.attack,
                stack,
                self.byzantine,
                generator=self.generator,
                columns=(shard.ranges, shard.width),
                **self.attack_kwargs,
            )
        start = time.perf_counter()
        f, kept, dropped = self.f, None, 0
        if self.filters_nonfinite:
            finite, f, kept = drop_nonfinite(stack, self.f, total)
            dropped = stack.shape[0] - finite.shape[0]
            stack = finite
        for name, kwargs in self.stages:
            spec = PRE_AGGREGATORS[name]
            kwargs = {**kwargs, **({"generator": self.generator} if spec.needs_generator else {})}
            kwargs.update({"total": total} if spec.totals else {})
            stack = spec.fn(stack, f, **kwargs) if spec.needs_f else spec.fn(stack, **kwargs)
        totals = {"total": total} if self.spec.totals else {}
        kwargs = {**self.rule_kwargs, **totals}
        picks = None
        if self.spec.select is not None:  # the picks once: the vector from them, and the metric
            picks = unfiltered(self.spec.select)(stack, f, **kwargs)
            assert self.spec.from_picks is not None
            vector = self.spec.from_picks(stack, picks, f)
        else:
            if self.spec.stateful:
                kwargs["center"] = None if self.center is None else shard.take(self.center)
            vector = unfiltered(self.spec.fn)(stack, f, **kwargs)
        seconds = time.perf_counter() - start
        if self.spec.stateful:
            if self.center is None or self.center.shape[0] != shard.width:
                self.center = vector.new_zeros(shard.width)
            shard.put(self.center, vector.detach())
        selected = None
        if picks is not None and all(PRE_AGGREGATORS[name].preserves_rows for name, _ in self.stages):
            if kept is not None:
                picks = kept[picks]
            selected = sum(int(i) in byzantine for i in picks.tolist()) / len(picks)
        distance = float(total(sq_distance_to_mean(vector, sent, honest).reshape(1)).sqrt())
        return AggregationResult(vector, distance, selected, dropped, seconds)

    def state_dict(self) -> dict[str, Any]:
        """The rule's centre (``centered_clipping``) and the generator's state."""
        center = None if self.center is None else self.center.clone()  # updated in place by the next step
        return {"center": center, "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        center = state.get("center")
        self.center = None if center is None else center.clone()
        self.generator.set_state(state["generator"])

    def __getstate__(self) -> dict[str, Any]:
        # A torch.Generator does not survive torch.multiprocessing's pickling (the spawned child dies with "unable to
        # resize file"), nor would a tensor of its state, which that pickler moves through shared memory: ship the
        # state as plain bytes and rebuild the generator on the other side.
        state = dict(self.__dict__)
        state["generator"] = bytes(self.generator.get_state().numpy())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        generator = torch.Generator()
        generator.set_state(torch.frombuffer(bytearray(state.pop("generator")), dtype=torch.uint8))
        self.__dict__.update(state, generator=generator)
