"""The data-parallel engine of ``ddp_scratch``, the same object under the Trainer and under Fabric.

Runbook::

    engine = DataParallelEngine(module, policy, bucket_cap_bytes=25 * 2**20)  # casts per the policy, hooks gradients
    engine.attach_optimizers([optimizer])    # fp32 master copies where the policy keeps them
    with engine.reducer.no_sync():
        loss.backward()                      # a non-boundary micro-batch: accumulates, communicates nothing
    loss.backward()                          # buckets all-reduced while backward runs
    engine.before_step(optimizer)            # the masters' .grad bound to the accumulated gradients
    optimizer.step()
    engine.after_step(optimizer)             # the updated masters rounded into the module

The precision policy ([Note: precision policy] in ``lightning_zero/training/precision.py``) decides the rest: under
``-true`` (or ``cast_module=True``) the module's parameters are low precision, the optimizer steps fp32 master copies
(:class:`~lightning_zero.training.precision.MasterWeights`) and gradients accumulate in fp32 buckets (the reducer's
accumulation buckets); otherwise the parameters are their own masters and ``p.grad`` is a view of its bucket.

Gradient compression (``compression``, :mod:`lightning_zero.comm.powersgd`): one
:class:`~lightning_zero.comm.powersgd.PowerSGDCompressor` for the engine's life, handed to every reducer it builds;
when the buckets are rebuilt (the trainable parameters changed) its per-bucket memories start again.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.hierarchy import bucket_algorithm
from lightning_zero.comm.link_model import LinkModel
from lightning_zero.comm.powersgd import CHECKPOINT_KEY, PowerSGDCompressor
from lightning_zero.comm.powersgd_config import PowerSGDConfig
from lightning_zero.dp.reducer import GradientReducer
from lightning_zero.optim.sharding import restart_on_zero_grad, toggled_off
from lightning_zero.training.precision import MasterWeights, PrecisionPolicy


class DataParallelEngine:
    """Gradient averaging (and master weights) for ``module``; see the module docstring.

    Args:
        module: the model, on its device.
        policy: the run's precision policy.
        bucket_cap_bytes: cap of one gradient bucket.
        first_bucket_cap_bytes: cap of the first bucket when the buckets are rebuilt by arrival order ([Note: bucket
            rebuild] in ``lightning_zero/dp/rebuild.py``); ``None``: ``bucket_cap_bytes``.
        all_reduce_algorithm: the buckets' all-reduce: ``"auto"`` (:func:`~lightning_zero.comm.hierarchy.
            bucket_algorithm`), ``"native"``, ``"ring"`` or ``"hierarchical"``.
        ranks_per_node: the job's processes per node (the hierarchy's nodes).
        link_model: what ``"auto"`` chooses from (``None``: the network lab's).
        find_unused_parameters: see :class:`~lightning_zero.dp.reducer.GradientReducer`.
        compression: PowerSGD's settings, or ``None`` for the plain all-reduce.
    """

    def __init__(
        self,
        module: nn.Module,
        policy: PrecisionPolicy,
        *,
        bucket_cap_bytes: int,
        find_unused_parameters: bool,
        compression: PowerSGDConfig | None = None,
        first_bucket_cap_bytes: int | None = None,
        all_reduce_algorithm: str = "native",
        ranks_per_node: int = 1,
        link_model: LinkModel | None = None,
    ) -> None:
        self.module, self.policy = module, policy
        self.all_reduce_algorithm, self.ranks_per_node = all_reduce_algorithm, ranks_per_node
        self.link_model = link_model
        self.bucket_cap_bytes, self.find_unused_parameters = bucket_cap_bytes, find_unused_parameters
        self.first_bucket_cap_bytes = first_bucket_cap_bytes
        self.compressor = PowerSGDCompressor(compression) if compression is not None else None
        self._originals = self._cast_params()
        low = {p.dtype for p in module.parameters() if p.requires_grad and policy.master(p.dtype) is not None}
        self.master_dtype = policy.master_dtype if low else None
        self.reducer: GradientReducer | None = None
        self._final_order: list[str] | None = None  # the last reducer's bucket order, once it is removed
        self._masters: dict[int, MasterWeights] = {}  # id(optimizer) -> its master copies
        self._master_of: dict[int, Tensor] = {}  # id(parameter) -> its master
        self.rebuild_reducer()

    def _cast_params(self) -> dict[int, Tensor]:
        """Cast the parameters to the policy's ``cast_dtype``; return their values from before (for the masters)."""
        originals = {}
        dtype = self.policy.cast_dtype
        if dtype is not None:
            for p in self.module.parameters():
                if p.is_floating_point() and p.dtype != dtype:
                    originals[id(p)] = p.detach().clone()
                    p.data = p.data.to(dtype)
        return originals

    def rebuild_reducer(self) -> None:
        """Buckets over the parameters trainable now (at construction, and when the trainable set changes)."""
        old = self.reducer
        self.reducer = GradientReducer.for_module(
            self.module,
            bucket_cap_bytes=self.bucket_cap_bytes,
            first_bucket_cap_bytes=self.first_bucket_cap_bytes,
            all_reduce_options=self._all_reduce_options,
            find_unused_parameters=self.find_unused_parameters,
            grad_dtype=self.master_dtype,  # masters: gradients accumulate in their dtype
            reduce_dtype=self.policy.reduce_dtype,
            compressor=self.compressor,
            ignored=self._master_off if self.master_dtype is not None else None,
        )
        if old is not None:  # rebuilt inside a run, maybe inside a no_sync window
            old.remove()
            self.reducer.require_backward_grad_sync = old.require_backward_grad_sync
            if self.compressor is not None:
                self.compressor.reset_buckets()

    def _all_reduce_options(self, nbytes: int) -> dict[str, Any]:
        """A bucket's all-reduce algorithm (and the hierarchy's nodes), by its bytes."""
        algorithm = bucket_algorithm(
            self.all_reduce_algorithm,
            nbytes,
            backend=comm.backend(),
            world_size=comm.world_size(),
            ranks_per_node=self.ranks_per_node,
            link_model=self.link_model,
        )
        return {"algorithm": algorithm, "ranks_per_node": self.ranks_per_node}

    def _master_off(self, p: Tensor) -> bool:
        """Whether ``p``'s master is turned off (its optimizer toggled off: [Note: toggled-off optimizers] in
        ``lightning_zero/optim/sharding.py``)."""
        master = self._master_of.get(id(p))
        return master is not None and not master.requires_grad

    def toggled_off(self) -> AbstractContextManager:
        """Backward with the parameters whose masters are toggled off turned off too."""
        return toggled_off(self.master_pairs)

    def attach_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Rebuild each optimizer's param groups over fp32 masters when the policy keeps them (state moved along)."""
        if self.master_dtype is not None:
            self._masters = {id(o): MasterWeights(o, self.master_dtype, self._originals) for o in optimizers}
            for optimizer in optimizers:  # [Note: zero_grad reaches the engine] in lightning_zero/optim/sharding.py
                restart_on_zero_grad(optimizer, partial(self.restart_window, optimizer))
            self._master_of = {id(p): master for p, master in self.master_pairs}
        self._originals = {}

    def masters_of(self, optimizer: Any) -> MasterWeights | None:
        """The master copies stepped by ``optimizer`` (or by the optimizer it wraps), if any."""
        return self._masters.get(id(getattr(optimizer, "_optimizer", optimizer)))

    @property
    def master_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """Every (parameter, its fp32 master) pair, when master weights are kept."""
        return [pair for masters in self._masters.values() for pair in masters.pairs]

    def before_step(self, optimizer: Any) -> None:
        """After the window's last backward: the masters' gradients are the accumulated, averaged ones."""
        masters = self.masters_of(optimizer)
        if masters is not None and self.reducer is not None:
            masters.bind_grads(self.reducer.grad_of)

    def after_step(self, optimizer: Any) -> None:
        """After the optimizer step: the updated masters rounded into the module; the window ends."""
        masters = self.masters_of(optimizer)
        if masters is not None and self.reducer is not None:
            masters.after_step()
            self._end_window(masters)

    def restart_window(self, optimizer: Any) -> None:
        """``optimizer.zero_grad()`` with masters: its parameters' gradients dropped from the accumulation buckets
        too, as ``zero_grad`` drops them under ``ddp``."""
        masters = self.masters_of(optimizer)
        if masters is not None and self.reducer is not None:
            self._end_window(masters)
            for p, _ in masters.pairs:
                p.grad = None

    def _end_window(self, masters: MasterWeights) -> None:
        """The reducer's window of ``masters``' parameters ends (each optimizer has its own)."""
        assert self.reducer is not None
        self.reducer.end_window(self.reducer.indices_of(p for p, _ in masters.pairs))

    def add_masters_to_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        """``optimizer.state_dict()`` with each parameter's fp32 ``"master"`` when master weights are kept."""
        masters = self.masters_of(optimizer)
        if masters is not None:
            masters.add_to_state_dict(state)

    def load_masters_from_state(self, optimizer: Any, state: dict[str, Any]) -> None:
        """Pop the ``"master"`` entries of a loaded optimizer state: into the masters, or (a run without masters)
        into the parameters, whose exact values they are."""
        masters = self.masters_of(optimizer)
        if masters is not None:
            masters.load_from_state_dict(state)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for number, p in enumerate(params):
            master = state["state"].get(number, {}).pop("master", None)
            if master is not None:
                p.data.copy_(master)

    @property
    def strategy_buffers(self) -> list[Tensor]:
        """The reducer's buckets (while it exists) and the compressor's memories (kept for a checkpoint after fit)."""
        buffers = self.reducer.buffers if self.reducer is not None else []
        return buffers + (self.compressor.buffers if self.compressor is not None else [])

    def compressor_state(self) -> dict[str, Any]:
        """``{CHECKPOINT_KEY: compressor state}`` with compression, else ``{}``. A collective with compression. The
        state carries the buckets' order once they were rebuilt (``"bucket_order"``, else ``None``): the memories are
        per bucket."""
        if self.compressor is None:
            return {}
        order = self.reducer.rebuilt_order if self.reducer is not None else self._final_order
        return {CHECKPOINT_KEY: {**self.compressor.state_dict(), "bucket_order": order}}

    def load_compressor_state(self, checkpoint: Mapping[str, Any]) -> None:
        """The compressor's state from a checkpoint that has it, with the bucket layout its memories belong to (a
        checkpoint from before the buckets were rebuilt by arrival keeps the first layout); a checkpoint without it
        leaves a fresh compressor, a run without compression ignores it."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None or self.compressor is None:
            return
        order = state.get("bucket_order")
        if self.reducer is not None:
            if order is not None:
                self.reducer.rebucket(order)
            elif state["buckets"]:
                self.reducer.keep_layout()
        self.compressor.load_state_dict(state)

    def remove(self) -> None:
        """The end of a run: hooks removed; a cast module gets the master values back in their dtype. The masters
        stay, as ZeRO's shards do: a checkpoint saved after the run carries them."""
        if self.reducer is not None:
            self._final_order = self.reducer.rebuilt_order  # what a checkpoint saved after the run needs
            self.reducer.remove()
            self.reducer = None
        for masters in self._masters.values():
            restart_on_zero_grad(masters.optimizer, None)
        if self.policy.casts_module:
            for masters in self._masters.values():
                masters.restore_dtype()
