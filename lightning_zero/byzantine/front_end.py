"""The Byzantine ranks mode in a strategy: what the Trainer's and Fabric's ``robust_ddp_scratch`` share.

:class:`ByzantineFrontEnd` is a mixin placed before the strategy's base class: it turns ``byzantine_ranks=f`` into a
:class:`~lightning_zero.byzantine.exchange.ByzantineExchange` on the robust engine, refuses bad settings when the
strategy is built and again when the world size is known, routes the strategy's ``barrier``, ``broadcast``,
``all_reduce`` and buffer broadcast over the signed transport once the step protocol runs ([Note: tolerant
collectives] in ``lightning_zero/byzantine/collectives.py``), syncs the module's torchmetrics over it, and adds the
membership and proofs to the robust checkpoint state.

The transport stays up after a fit's teardown (it closes when the next fit begins and at exit): a ``validate`` or
``test`` after the fit keeps its collectives tolerant, over the fit's last membership, where through gloo one crashed
rank would fail them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_zero.byzantine.collectives import TolerantCollectives
from lightning_zero.byzantine.exchange import ByzantineExchange, check_settings
from lightning_zero.robust.engine import RobustEngine
from lightning_zero.training.distributed import reduce_op_name

SETTINGS = ("byzantine_ranks", "byzantine_timeout", "byzantine_rank_behaviour", "byzantine_behaving_ranks")
"""The Byzantine ranks settings (documented on :class:`~lightning_zero.strategies.robust.RobustDDPStrategy`)."""


class ByzantineFrontEnd:
    """The Byzantine ranks mode of a ``robust_ddp_scratch`` front end (``self.robust_engine``); see the module
    docstring. Call :meth:`_check_byzantine` before the engine is built and :meth:`_attach_byzantine` after."""

    robust_engine: RobustEngine
    num_nodes: int
    num_processes: int
    cluster_environment: Any
    _launcher: Any

    def _check_byzantine(
        self,
        aggregator: str,
        aggregation_replicas: int,
        workers_per_rank: int,
        byzantine_ranks: int = 0,
        byzantine_timeout: float = 10.0,
        byzantine_rank_behaviour: str | None = None,
        byzantine_behaving_ranks: Sequence[int] | None = None,
    ) -> None:
        """The settings, checked before the engine is built (the world size is not known yet)."""
        behaving = None if byzantine_behaving_ranks is None else list(byzantine_behaving_ranks)
        self._byzantine: dict[str, Any] = {
            "byzantine_ranks": byzantine_ranks, "byzantine_timeout": byzantine_timeout, "aggregator": aggregator,
            "aggregation_replicas": aggregation_replicas, "byzantine_rank_behaviour": byzantine_rank_behaviour,
            "byzantine_behaving_ranks": behaving, "workers_per_rank": workers_per_rank,
        }  # fmt: skip
        check_settings(**self._byzantine)

    def _attach_byzantine(self) -> None:
        """With ``byzantine_ranks``, the engine's exchange becomes the mode's (once the engine is built)."""
        settings = self._byzantine
        if settings["byzantine_ranks"]:
            self.robust_engine.exchange = ByzantineExchange(  # type: ignore[assignment]
                settings["byzantine_ranks"], settings["byzantine_timeout"], settings["byzantine_rank_behaviour"],
                settings["byzantine_behaving_ranks"],
            )  # fmt: skip

    def _launch_without_observer(self, plain: type, tolerant: type) -> None:
        """In the mode, Lightning's popen launcher (``plain``) becomes ``tolerant``: Lightning's observer would
        SIGKILL every rank when one crashes (``lightning_zero/byzantine/launcher.py``)."""
        if self.byzantine_exchange is not None and type(self._launcher) is plain:
            self._launcher = tolerant(self.cluster_environment, self.num_processes, self.num_nodes)

    def _check_byzantine_world(self) -> None:
        """The settings against the world size, before any process starts."""
        check_settings(**self._byzantine, world_size=self.num_nodes * self.num_processes)

    @property
    def byzantine_exchange(self) -> ByzantineExchange | None:
        exchange = self.robust_engine.exchange
        return exchange if isinstance(exchange, ByzantineExchange) else None

    @property
    def evicted_ranks(self) -> frozenset[int]:
        """The ranks this rank's protocol evicted so far (the CLI tolerates their processes' failure)."""
        exchange = self.byzantine_exchange
        return frozenset(rank for _, rank, _ in exchange.evictions) if exchange is not None else frozenset()

    def byzantine_metrics(self) -> dict[str, float]:
        """The last step's ``byzantine/*`` metrics (none without the mode)."""
        exchange = self.byzantine_exchange
        return exchange.metrics() if exchange is not None else {}

    # ------------------------------------------------------------ the strategy's collectives
    def _tolerant(self) -> TolerantCollectives | None:
        """Once the step protocol runs: the collectives over the signed transport; before, gloo's."""
        exchange = self.byzantine_exchange
        return exchange.collectives if exchange is not None and exchange.running else None

    def barrier(self, name: str | None = None) -> None:
        calls = self._tolerant()
        if calls is None:
            super().barrier(name)  # type: ignore[misc]
        else:
            calls.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        calls = self._tolerant()
        return super().broadcast(obj, src) if calls is None else calls.broadcast(obj, src)  # type: ignore[misc]

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        calls = self._tolerant()
        if calls is None or not isinstance(tensor, Tensor) or group is not None:
            return super().all_reduce(tensor, group, reduce_op)  # type: ignore[misc]
        return calls.all_reduce(tensor, reduce_op_name(reduce_op))

    def _sync_buffers(self, module: Module) -> None:
        """Rank 0's buffers before a forward (torch DDP's buffer rule): once the protocol runs, one tolerant
        ``broadcast`` of them all, so that a crashed or silent rank cannot stop it; a buffer that does not come
        (rank 0 gone) or does not match this rank's in name, dtype and shape keeps this rank's value."""
        calls = self._tolerant()
        if calls is None:
            super()._sync_buffers(module)  # type: ignore[misc]
            return
        buffers = dict(module.named_buffers())
        theirs = calls.broadcast({name: b.detach().cpu() for name, b in buffers.items()}, src=0)
        if not isinstance(theirs, dict):
            return
        with torch.no_grad():
            for name, own in buffers.items():
                value = theirs.get(name)
                if isinstance(value, Tensor) and value.dtype == own.dtype and value.shape == own.shape:
                    own.copy_(value)

    def _tolerant_metrics(self, module: Module) -> None:
        """Every torchmetrics ``Metric`` of ``module`` syncs its states over the signed transport once the protocol
        runs (``dist_sync_fn``; before, torchmetrics' own gather): through gloo, one crashed rank would fail the
        first ``compute()`` of a validation after it. A metric given a ``dist_sync_fn`` of its own keeps it; one
        created after the strategy's setup (not in the module's ``__init__``, as torchmetrics asks) keeps gloo's."""
        if self.byzantine_exchange is None:
            return
        for metric in module.modules():
            if isinstance(metric, Metric) and metric.dist_sync_fn in (None, self._sync_metric_state):
                metric.dist_sync_fn = self._sync_metric_state

    def _sync_metric_state(self, tensor: Tensor, group: Any = None) -> list[Tensor]:
        calls = self._tolerant()
        return gather_all_tensors(tensor, group) if calls is None or group is not None else calls.gather_all(tensor)

    # ------------------------------------------------------------ checkpoints and teardown
    def robust_state_dict(self) -> dict[str, Any]:
        """The robust state, and with ``byzantine_ranks`` the membership and proofs ([Note: eviction])."""
        state = super().robust_state_dict()  # type: ignore[misc]
        exchange = self.byzantine_exchange
        if exchange is not None:
            state["byzantine"] = exchange.state_dict()
        return state

    def load_robust_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_robust_state_dict(state)  # type: ignore[misc]
        exchange = self.byzantine_exchange
        if (exchange is not None) != ("byzantine" in state):
            raise ValueError(
                "the checkpoint's robust state and this run disagree on byzantine_ranks: resume a Byzantine ranks"
                " run with byzantine_ranks set, and another run without it"
            )
        if exchange is not None:
            exchange.load_state_dict(state["byzantine"])
