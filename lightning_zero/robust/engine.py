"""The robust-aggregation engine of ``robust_ddp_scratch``, the same object under the Trainer
(:class:`lightning_zero.strategies.robust.RobustDDPStrategy`) and under Fabric
(:class:`lightning_zero.fabric.robust.RobustDDPStrategy`).

Runbook::

    engine = build_engine(aggregator="trimmed_mean", f=1, workers_per_rank=2)  # the settings checked
    engine.validate(world_size=2)                # n = 2 x 2 workers: the rule's bounds, the attack's workers
    engine.attach(module, find_unused_parameters=False)   # the (k, d) worker rows over the trainable parameters
    for j, chunk in enumerate(engine.worker_chunks(batch)):  # split; label_flip on the Byzantine workers' chunks
        with engine.worker_backward(j):          # the window opens on the first; p.grad bound to row j
            loss_fn(module(chunk)).backward()
        engine.send(j)                           # optional, the window's last micro-batch: sharded, j's exchange starts
    metrics = engine.aggregate()                 # once per optimizer step: every rank's rows all-gathered, the rule
    optimizer.step()                             # p.grad: views of the aggregate (the same on every rank)

With ``sharded_aggregation=True`` each rank instead receives its column shard of every worker's vector and
aggregates it (:class:`~lightning_zero.robust.exchange.ShardedExchange`, [Note: sharded aggregation] in
:mod:`lightning_zero.robust.shards`); the aggregate is the same up to the order of float sums.

The engine does not know who drives it: the front ends decide when a window's last backward has run (the Trainer
after the boundary micro-batch's backward, Fabric lazily before clipping or the optimizer step) and what to do with
the metrics (``self.log`` or :attr:`RobustEngine.last_metrics`). Ranks and world size are the process group's
(:mod:`lightning_zero.comm.collectives`); without one, a single process.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from torch import Tensor, nn

from lightning_zero.comm import collectives as comm
from lightning_zero.dp.unused import unused_error
from lightning_zero.robust.aggregation import AggregationResult, RobustAggregator
from lightning_zero.robust.attacks import flip_labels
from lightning_zero.robust.exchange import ShardedExchange, gather_rows
from lightning_zero.robust.shards import check_replicas
from lightning_zero.robust.workers import WorkerGradients, split_batch

CHECKPOINT_KEY = "robust_aggregation"
"""The checkpoint entry holding the worker momentum (all ``n`` rows), the rule's centre and the generator state."""


def check_workers(workers_per_rank: Any, worker_momentum: Any) -> None:
    """The worker settings (shared with the Hydra schema in :mod:`lightning_zero.tools.config_schema`)."""
    if isinstance(workers_per_rank, bool) or not isinstance(workers_per_rank, int) or workers_per_rank < 1:
        raise ValueError(f"workers_per_rank={workers_per_rank!r} is invalid: expected an integer >= 1")
    if not 0 <= worker_momentum < 1:
        raise ValueError(f"worker_momentum={worker_momentum!r} is invalid: expected a number in [0, 1)")


def check_precision_settings(
    param_dtype: Any = "auto", reduce_dtype: Any = "auto", master_weights: bool = False, cast_module: bool = False
) -> None:
    """The aggregation runs in the parameters' dtype, on the parameters themselves: no master copies, no cast of
    the module, no separate communication dtype (shared with the Hydra schema in
    :mod:`lightning_zero.tools.config_schema`)."""
    if master_weights or cast_module or param_dtype not in ("auto", None):
        raise ValueError(
            "robust_ddp_scratch keeps no fp32 master weights: leave master_weights=False, cast_module=False and"
            " param_dtype='auto' (under any precision the optimizer then updates the module's own parameters, as"
            " under Lightning's ddp)"
        )
    if reduce_dtype not in ("auto", None):
        raise ValueError(
            f"reduce_dtype={reduce_dtype} is not supported by robust_ddp_scratch: its workers' rows are all-gathered in"
            " the parameters' dtype; leave it 'auto'"
        )


SETTINGS = (
    "aggregator", "f", "aggregator_kwargs", "pre_aggregators", "workers_per_rank", "worker_momentum", "attack",
    "attack_kwargs", "byzantine_workers", "seed", "sharded_aggregation", "aggregation_replicas",
)  # fmt: skip
"""The front ends' robust settings (documented on :class:`~lightning_zero.strategies.robust.RobustDDPStrategy`)."""


def build_engine(
    aggregator: str = "mean",
    *,
    workers_per_rank: int = 1,
    worker_momentum: float = 0.0,
    aggregator_kwargs: Mapping[str, Any] | None = None,
    byzantine_workers: Sequence[int] | None = None,
    sharded_aggregation: bool = False,
    aggregation_replicas: int = 1,
    **rule: Any,
) -> RobustEngine:
    """The engine of the front ends' :data:`SETTINGS`, each bad one raising naming itself (``f``,
    ``pre_aggregators``, ``attack``, ``attack_kwargs`` and ``seed`` in ``rule``, as
    :class:`~lightning_zero.robust.aggregation.RobustAggregator` takes them); the rule's bounds for ``n`` are
    checked later, by :meth:`RobustEngine.validate`."""
    check_workers(workers_per_rank, worker_momentum)
    check_sharding(sharded_aggregation, aggregation_replicas)
    aggregation = RobustAggregator(aggregator, rule_kwargs=aggregator_kwargs, byzantine=byzantine_workers, **rule)
    return RobustEngine(aggregation, workers_per_rank, worker_momentum, sharded_aggregation, aggregation_replicas)


def check_sharding(sharded_aggregation: Any, aggregation_replicas: Any, world_size: int | None = None) -> None:
    """``sharded_aggregation`` and ``aggregation_replicas`` (``None``: before the world size is known; shared with the
    Hydra schema in :mod:`lightning_zero.tools.config_schema`)."""
    if not isinstance(sharded_aggregation, bool):
        raise ValueError(f"sharded_aggregation={sharded_aggregation!r} is invalid: expected True or False")
    check_replicas(aggregation_replicas, world_size)
    if aggregation_replicas > 1 and not sharded_aggregation:
        raise ValueError(
            f"aggregation_replicas={aggregation_replicas} needs sharded_aggregation=True: it sets how many ranks"
            " aggregate each shard (without sharding every rank aggregates everything, unchecked)"
        )


class RobustEngine:
    """One rank's workers, their gradient rows and the robust rule; see the module docstring.

    Args:
        aggregator: the rule with its pre-aggregators and simulated attack.
        workers_per_rank: ``k``, the workers of this process.
        worker_momentum: ``beta`` in ``[0, 1)`` of every worker's momentum.
        sharded_aggregation: each rank aggregates a column shard of every worker's vector ([Note: sharded
            aggregation] in :mod:`lightning_zero.robust.shards`).
        aggregation_replicas: with ``sharded_aggregation``, how many ranks aggregate each shard and compare digests
            ([Note: replicated aggregation]).
    """

    def __init__(
        self,
        aggregator: RobustAggregator,
        workers_per_rank: int = 1,
        worker_momentum: float = 0.0,
        sharded_aggregation: bool = False,
        aggregation_replicas: int = 1,
    ) -> None:
        self.aggregator = aggregator
        self.workers_per_rank = workers_per_rank
        self.worker_momentum = worker_momentum
        self.exchange = ShardedExchange(aggregation_replicas) if sharded_aggregation else None
        """The sharded mode's exchange between ranks (:mod:`lightning_zero.robust.exchange`), else ``None``."""
        self._stack: Tensor | None = None  # unsharded: the (n, d) stack the rows are all-gathered into
        self.find_unused_parameters = False
        self.grads: WorkerGradients | None = None
        self.window_open = False
        self.last_result: AggregationResult | None = None
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------ topology
    @property
    def num_workers(self) -> int:
        """``n``: every process's workers together."""
        return self.workers_per_rank * comm.world_size()

    @property
    def first_worker(self) -> int:
        """The global index of this rank's first worker (global worker ``i`` is row ``i % k`` of rank ``i // k``)."""
        return comm.rank() * self.workers_per_rank

    def validate(self, world_size: int) -> None:
        """The rule's bounds and the simulated attack for ``n = workers_per_rank x world_size``, and
        ``aggregation_replicas <= world_size`` (before any process starts: the front end passes its topology)."""
        self.aggregator.validate(self.workers_per_rank * world_size)
        check_sharding(self.sharded_aggregation, self.aggregation_replicas, world_size)

    # ------------------------------------------------------------ setup
    def attach(
        self, module: nn.Module, *, find_unused_parameters: bool, groups: Sequence[Sequence[Tensor]] | None = None
    ) -> None:
        """The worker rows over ``module``'s trainable parameters, in registration order (a run's start; replaces
        earlier rows). ``groups``: the parameters of each of ZeRO's flat groups, in the group's order, whose shards
        are then this rank's columns ([Note: sharded aggregation] in :mod:`lightning_zero.robust.shards`)."""
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        params, names = [p for _, p in named], [name for name, _ in named]
        if self.grads is not None:
            self.grads.remove()
        self.grads = WorkerGradients(params, self.workers_per_rank, self.worker_momentum, names)
        index = {id(p): i for i, p in enumerate(params)}
        if self.exchange is not None:
            self.exchange.reset(None if groups is None else [[index[id(p)] for p in group] for group in groups])
        self._stack = None
        self.find_unused_parameters = find_unused_parameters
        self.window_open = False

    def _attached(self) -> WorkerGradients:
        if self.grads is None:
            raise RuntimeError("robust_ddp_scratch: the module is not set up yet (no worker rows to accumulate into)")
        return self.grads

    @property
    def buffers(self) -> list[Tensor]:
        """The worker rows (and momentum rows), what the last step received of every worker's vectors (the ``(n, d)``
        stack, or each round's ``(n, d / N)`` shard) and the sharded mode's gathered aggregate."""
        if self.grads is None:
            return []
        exchange = self.exchange.buffers if self.exchange is not None else []
        return self.grads.buffers + exchange + ([self._stack] if self._stack is not None else [])

    @property
    def sharded_aggregation(self) -> bool:
        return self.exchange is not None

    @property
    def aggregation_replicas(self) -> int:
        return self.exchange.replicas if self.exchange is not None else 1

    @property
    def received(self) -> list[Tensor]:
        """What this rank received of the workers' vectors at the last step (kept for the next): the ``(n, d)``
        stack, or each round's ``(n, columns)`` shard; nothing in one process."""
        exchange = self._exchange_now()
        if exchange is not None:
            return exchange.received
        return [self._stack] if self._stack is not None else []

    def remove(self) -> None:
        """The end of a run: the autograd hooks removed, the window closed. The rows stay, like an optimizer's state:
        the momentum rows belong in a checkpoint saved after the run."""
        self.window_open = False
        if self.grads is not None:
            self.grads.remove()

    # ------------------------------------------------------------ forward and backward: one per worker
    def worker_chunks(self, batch: Any) -> list[Any]:
        """This rank's micro-batch split into one chunk per worker; the simulated ``label_flip`` attack applied to
        the chunks of Byzantine workers."""
        first = self.first_worker
        chunks = split_batch(batch, self.workers_per_rank)
        if self.aggregator.data_attack:
            byzantine = self.aggregator.byzantine
            chunks = [self._flip_labels(c) if first + j in byzantine else c for j, c in enumerate(chunks)]
        return chunks

    def _flip_labels(self, chunk: Any) -> Any:
        if not (isinstance(chunk, (list, tuple)) and len(chunk) == 2 and isinstance(chunk[1], Tensor)):
            raise ValueError("attack='label_flip' needs (inputs, labels) batches")
        return type(chunk)((chunk[0], flip_labels(chunk[1], **self.aggregator.attack_kwargs)))

    def open_window(self) -> None:
        """The first backward after an optimizer step: the rows zeroed, the used-parameter record restarted."""
        grads = self._attached()
        if not self.window_open:
            grads.rows.zero_()
            grads.used.end_window()
            self.window_open = True

    @contextmanager
    def worker_backward(self, worker: int) -> Generator[None, None, None]:
        """Around one backward of local worker ``worker``: its gradients accumulate into its row."""
        if not 0 <= worker < self.workers_per_rank:
            raise ValueError(f"worker={worker} is out of range for workers_per_rank={self.workers_per_rank}")
        grads = self._attached()
        self.open_window()
        grads.bind(worker)
        try:
            yield
        finally:
            grads.collect(worker)

    # ------------------------------------------------------------ the optimizer step
    def _unused_everywhere(self) -> set[str]:
        """Parameters without a gradient in this window: an error, or with ``find_unused_parameters`` their rows
        stay zero and the parameters no rank used get ``p.grad = None`` (as under torch DDP)."""
        grads = self._attached()
        if not self.find_unused_parameters:
            unused = grads.used.unused_in_window()
            if unused:
                raise unused_error(unused)
            return set()
        return grads.used.find_unused_everywhere(grads.rows.device)

    def aggregate(self) -> dict[str, float]:
        """The window's end (collective): the rule run on every worker's rows, gathered (or each rank on its column
        shard), every ``p.grad`` bound to the aggregate. Returns the step's metrics (also in :attr:`last_metrics`, the
        result in :attr:`last_result`): ``robust/honest_distance``, ``robust/byzantine_selected`` (selection rules),
        ``robust/nonfinite_dropped``, ``robust/aggregation_ms`` and ``robust/comm_bytes`` (what this rank received of
        the workers' vectors: the all-gathered stack, or its shards by the all-to-all)."""
        grads = self._attached()
        unused = self._unused_everywhere()
        exchange = self._exchange_now()
        if exchange is not None:
            result, vector = exchange.aggregate(grads, self.aggregator, unused)
        else:
            vectors = grads.vectors()
            if comm.world_size() > 1 and (self._stack is None or self._stack.shape[1] != grads.numel):
                self._stack = vectors.new_empty(self.num_workers, grads.numel)
            result = self.aggregator(gather_rows(vectors, self._stack, tag="worker_grads"))
            vector = result.vector
        if vector is not None:
            grads.set_grads(vector, skip=unused)
        self.window_open = False
        self.last_result = result
        metrics = {
            "robust/honest_distance": result.honest_distance,
            "robust/nonfinite_dropped": float(result.dropped),
            "robust/aggregation_ms": result.seconds * 1e3,
            "robust/comm_bytes": float(sum(t.numel() * t.element_size() for t in self.received)),
        }
        if result.byzantine_selected is not None:
            metrics["robust/byzantine_selected"] = result.byzantine_selected
        self.last_metrics = metrics
        return metrics

    # ------------------------------------------------------------ sharded aggregation
    def _exchange_now(self) -> ShardedExchange | None:
        """The exchange, when there is one and more than one process (one process holds every column) or a sink to
        hand the aggregate to (robust ZeRO, in its optimizer shard's order)."""
        if self.exchange is None or (comm.world_size() == 1 and self.exchange.sink is None):
            return None
        return self.exchange

    def send(self, worker: int) -> None:
        """``worker``'s last backward of the window has run: in the sharded mode its vector's exchange starts now, so
        that it overlaps the next workers' backward (a no-op otherwise, and for a worker already sent).
        :meth:`aggregate` sends the workers not sent yet."""
        exchange = self._exchange_now()
        if exchange is not None:
            exchange.send(self._attached(), worker)

    # ------------------------------------------------------------ checkpoints
    def robust_state_dict(self) -> dict[str, Any]:
        """The aggregator's state and every worker's momentum row (a collective: every rank must call it)."""
        state: dict[str, Any] = {"num_workers": self.num_workers, **self.aggregator.state_dict()}
        exchange = self._exchange_now()
        if state["center"] is not None and exchange is not None:
            state["center"] = exchange.gather_center(state["center"], self._attached().numels).cpu()
        grads = self.grads
        momentum = grads.momentum_rows if grads is not None else None
        if momentum is not None:
            out = momentum.new_empty(self.num_workers, momentum.shape[1])
            # The exchange's own gather: the Byzantine ranks mode's runs over its signed transport, not gloo.
            gather = exchange.gather_rows if exchange is not None else partial(gather_rows, tag="checkpoint")
            momentum = gather(momentum, out).cpu().clone()  # a copy: one process returns its own rows
        state["worker_momentum"] = momentum
        return state

    def load_robust_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"the checkpoint's robust aggregation state is for n={state['num_workers']} workers, this run has"
                f" n={self.num_workers}: resume with the same devices x num_nodes x workers_per_rank"
            )
        self.aggregator.load_state_dict(state)
        momentum, grads = state.get("worker_momentum"), self.grads
        if momentum is not None and grads is not None and grads.momentum_rows is not None:
            first = self.first_worker
            grads.momentum_rows.copy_(momentum[first : first + self.workers_per_rank])


class RobustFrontEnd:
    """What both front ends of ``robust_ddp_scratch`` (the Trainer's and Fabric's strategy) say about their
    :class:`RobustEngine` (``self.robust_engine``); a mixin for a strategy on
    :class:`~lightning_zero.training.distributed.DistributedPlumbing`."""

    robust_engine: RobustEngine
    num_nodes: int
    num_processes: int
    _precision_settings: dict[str, Any]

    @property
    def aggregator(self) -> RobustAggregator:
        return self.robust_engine.aggregator

    @property
    def workers_per_rank(self) -> int:
        return self.robust_engine.workers_per_rank

    @property
    def worker_momentum(self) -> float:
        return self.robust_engine.worker_momentum

    @property
    def num_workers(self) -> int:
        """``n``: every process's workers together."""
        return self.workers_per_rank * self.num_nodes * self.num_processes

    @property
    def last_result(self) -> AggregationResult | None:
        """The last optimizer step's aggregation result."""
        return self.robust_engine.last_result

    def _check_robust_settings(self) -> None:
        """When the Trainer or Fabric attaches the devices, before any process starts: the rule's bounds for ``n``
        and the simulated attack."""
        self.robust_engine.validate(self.num_nodes * self.num_processes)

    def _check_precision(self) -> None:
        check_precision_settings(**self._precision_settings)

    def robust_state_dict(self) -> dict[str, Any]:
        """The aggregator's state and every worker's momentum row (a collective: every rank must call it)."""
        return self.robust_engine.robust_state_dict()

    def load_robust_state_dict(self, state: Mapping[str, Any]) -> None:
        self.robust_engine.load_robust_state_dict(state)
