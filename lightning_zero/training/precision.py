"""Mixed precision as a property of the gradient engines: the policy, its defaults, and the shard-aware loss scaler.

Runbook::

    Trainer(devices=2, strategy="zero3_scratch", precision="bf16-mixed")   # the defaults below
    ZeroStrategy(stage=2, reduce_dtype="bf16")                             # halve the gradient bytes too
    ZeroStrategy(stage=1, param_dtype=None)                                # bf16-mixed exactly as Lightning's ddp
    ZeroStrategy(stage=2, cast_module=True)                                # DeepSpeed's bf16 mode: 2 bytes/param
    ScratchDDPStrategy(master_weights=False)                               # bf16-true without fp32 masters

[Note: precision policy] In the spirit of FSDP2's ``MixedPrecisionPolicy``, with DeepSpeed's fp32 master weights.
:class:`PrecisionPolicy` holds four dtypes:

- ``param_dtype``: the parameters are communicated in it and the module computes with their values rounded to it.
  ZeRO-1/2 all-gather the updated shards in it, ZeRO-3 gathers each unit in it (half the bytes of fp32 in bf16).
  The module's parameters keep their own dtype (fp32 under ``-mixed``), so any module that runs under Lightning's
  ``ddp`` at that precision runs here: Lightning's autocast computes the matmuls in bf16 as it would, and the other
  ops see bf16-rounded weights. ``None``: nothing is rounded (Lightning's ``ddp`` arithmetic, bit for bit).
- ``reduce_dtype``: the dtype gradients are averaged in (a copy per bucket or unit; the result is cast back).
- ``master_dtype``: fp32 *master weights*, the values the optimizer updates, kept apart from parameters that are
  rounded or stored in low precision (ZeRO: this rank's shard, so the extra is 4Ψ/N; ``ddp_scratch``: every
  parameter). Gradients accumulate across micro-batches in it (ZeRO-1/2's ``grad_accum_dtype`` stores them in
  another: [Note: tensor roles] in ``lightning_zero/zero/flat_group.py``). Checkpoints carry the masters (the
  ZeRO-3 shards are them; ZeRO-1/2 and ``ddp_scratch`` add each parameter's ``"master"`` to the optimizer state, as
  DeepSpeed keeps its fp32 partitions), so a resume is bit-identical; a fit hands the masters back into the module,
  in its own dtype.
- ``cast_dtype`` (``cast_module=True``, ``-mixed`` only): keep the module's parameters and floating-point buffers in
  the low-precision dtype and cast floating-point inputs to it, as DeepSpeed's ``bf16``/``fp16`` modes do: the ZeRO
  paper's 2 bytes per parameter. It needs a module whose forward never mixes that dtype with float32 tensors of its
  own: Lightning's demo ``Transformer`` adds a float32 positional table to bf16 embeddings, and CPU ``layer_norm``
  then refuses a bf16 weight ("mixed dtype (CPU)").

Defaults from the Trainer's ``precision``; a strategy setting overrides each:

===============  ====================================  ============  ===========  ==========================
precision        computed in / param_dtype              reduced in    accumulated  stored / updated
===============  ====================================  ============  ===========  ==========================
``32-true``      fp32 / none                            fp32          fp32         fp32 parameters
``bf16-mixed``   autocast bf16 / ZeRO bf16, DDP none    fp32          fp32         fp32 (ZeRO: fp32 master)
``16-mixed``     autocast fp16 / ZeRO fp16, DDP none    fp32          fp32         fp32 (ZeRO: fp32 master)
``bf16-true``    bf16 (Lightning casts the module)      fp32          fp32         bf16 params + fp32 master
``16-true``      fp16 (Lightning casts the module)      fp32          fp32         fp16 params + fp32 master
===============  ====================================  ============  ===========  ==========================

``16-mixed`` scales the loss: :class:`ShardedGradScaler` replaces the plugin's ``GradScaler`` so that an inf/NaN in
any rank's shard makes every rank skip the step and back off alike. ``robust_ddp_scratch`` aggregates and steps the
module's own parameters: no masters, no ``cast_module``, no ``reduce_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_zero.comm import collectives as comm

DTYPE_NAMES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
LOW_PRECISION = {
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}
"""Lightning's low-precision ``precision`` values and the dtype each computes in."""

_LEGACY_PRECISION = {"bf16": "bf16-mixed", "16": "16-mixed", "32": "32-true", "64": "64-true"}


def unified_precision(value: Any) -> str:
    """A Trainer ``precision`` value in Lightning's unified spelling (``16`` -> ``"16-mixed"``, ``"bf16"`` ->
    ``"bf16-mixed"``, ``32`` -> ``"32-true"``)."""
    return _LEGACY_PRECISION.get(str(value), str(value))


DEFAULT = "auto"
"""A setting left to the default of the Trainer's precision (``None`` is a value: "the module's dtype")."""


def parse_dtype(setting: str, value: Any) -> torch.dtype | None:
    """``"bf16"``/``"fp16"``/``"fp32"`` (or their torch names, or a ``torch.dtype``) to a dtype; ``None`` stays."""
    if value is None:
        return None
    if isinstance(value, str) and value == DEFAULT:
        return DEFAULT
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    if isinstance(value, str) and value in DTYPE_NAMES:
        return DTYPE_NAMES[value]
    raise ValueError(
        f"{setting}={value!r} is invalid: expected 'auto', one of {sorted(DTYPE_NAMES)}, a torch dtype or None"
    )


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of one run ([Note: precision policy]); built by :func:`resolve_policy`."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = None
    cast_dtype: torch.dtype | None = None

    @property
    def casts_module(self) -> bool:
        """Whether the strategy casts the module (``cast_module=True`` under ``-mixed``)."""
        return self.cast_dtype is not None

    def master(self, param_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype of a master copy of a parameter held in ``param_dtype`` (``None``: no copy)."""
        return None if self.master_dtype in (None, param_dtype) else self.master_dtype


def resolve_policy(
    precision: str,
    *,
    param_dtype: Any = DEFAULT,
    reduce_dtype: Any = DEFAULT,
    master_weights: bool = True,
    cast_module: bool = False,
    sharded: bool,
) -> PrecisionPolicy:
    """The policy of a run at Lightning ``precision`` with the strategy's settings (see the table above).

    ``sharded``: a ZeRO stage, whose parameters are gathered (``param_dtype`` defaults to the low-precision dtype), or
    a strategy that gathers no parameters (``param_dtype`` has nothing to apply to).
    """
    param, reduce = parse_dtype("param_dtype", param_dtype), parse_dtype("reduce_dtype", reduce_dtype)
    low = LOW_PRECISION.get(precision)
    if reduce is DEFAULT:
        reduce = torch.float32 if low is not None else None
    if low is None:  # 32-true, 64-true or a plugin of the user's: the module's dtype throughout
        if param not in (None, DEFAULT) or cast_module:
            setting = f"param_dtype={param}" if param not in (None, DEFAULT) else "cast_module=True"
            raise ValueError(
                f"{setting} needs a low-precision Trainer precision ('bf16-mixed', '16-mixed', 'bf16-true' or"
                f" '16-true'); this run has precision={precision!r}"
            )
        return PrecisionPolicy(reduce_dtype=reduce)
    if param not in (None, DEFAULT, low):
        raise ValueError(f"param_dtype={param} conflicts with precision={precision!r}: expected {low}, 'auto' or None")
    if precision.endswith("-true"):  # Lightning casts the whole module, inputs included
        return PrecisionPolicy(low, reduce, torch.float32 if master_weights else None)
    if param is DEFAULT:
        param = low if sharded or cast_module else None
    if param is None and cast_module:
        raise ValueError(f"cast_module=True casts the module to param_dtype: it needs param_dtype={low} (or 'auto')")
    if param is not None and not (sharded or cast_module):
        raise ValueError(
            f"param_dtype={param} rounds the parameters ZeRO gathers, and this strategy gathers none: pass"
            " cast_module=True to keep the module itself in it"
        )
    if param is not None and not master_weights and not cast_module:
        raise ValueError(
            f"master_weights=False with param_dtype={param} and an fp32 module would round only the other ranks'"
            " shards: pass cast_module=True (the optimizer then updates low-precision parameters) or keep the masters"
        )
    master = torch.float32 if param is not None and master_weights else None
    return PrecisionPolicy(param, reduce, master, low if cast_module else None)


def cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    """Cast ``module``'s floating-point buffers to ``dtype``; return the dtypes they had (by name)."""
    before = {}
    if dtype is None:
        return before
    for name, buffer in module.named_buffers():
        if buffer.is_floating_point() and buffer.dtype != dtype:
            before[name] = buffer.dtype
            buffer.data = buffer.data.to(dtype)
    return before


def restore_buffers(module: nn.Module, dtypes: dict[str, torch.dtype]) -> None:
    """Undo :func:`cast_buffers`."""
    for name, buffer in module.named_buffers():
        if name in dtypes:
            buffer.data = buffer.data.to(dtypes[name])


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in ``data`` (a batch) cast to ``dtype``, as Lightning's half-precision plugins do."""
    from lightning.fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(data, Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t)


def _as_master(value: Any, master: Tensor) -> Any:
    """An optimizer state value of a parameter, for its master: shaped like it, in its dtype."""
    if isinstance(value, Tensor) and value.is_floating_point() and value.shape == master.shape:
        return value.to(master.dtype)
    return value


class MasterWeights:
    """``ddp_scratch``'s master copies: the optimizer steps fp32 copies of low-precision parameters.

    Built over an optimizer whose param groups hold the module's parameters; rebuilds the groups in place over the
    masters, as ZeRO rebuilds them over shards, and moves state the optimizer already holds (Adagrad's sums, made by its
    constructor) to them, its tensors shaped like the parameter in the master's dtype. ``grad_of(p)`` gives where the
    (reduced) gradient of ``p`` lives in ``dtype`` (the reducer's accumulation buckets).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, dtype: torch.dtype, originals: dict[int, Tensor]) -> None:
        self.optimizer = optimizer
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for group in optimizer.param_groups:
            masters = []
            for p in group["params"]:
                value = originals.get(id(p), p.detach())
                master = nn.Parameter(value.to(dtype, copy=True), requires_grad=p.requires_grad)
                if p in optimizer.state:
                    state = optimizer.state.pop(p)
                    optimizer.state[master] = {k: _as_master(v, master) for k, v in state.items()}
                self.pairs.append((p, master))
                masters.append(master)
            group["params"] = masters

    def bind_grads(self, grad_of: Any) -> None:
        """Before the step: each master's ``.grad`` is its parameter's accumulated gradient (``None`` if none)."""
        for p, master in self.pairs:
            master.grad = grad_of(p)

    def after_step(self) -> None:
        """The updated masters rounded into the module's parameters; gradients released."""
        for p, master in self.pairs:
            p.data.copy_(master.detach())
            master.grad = None

    def add_to_state_dict(self, state: dict[str, Any]) -> None:
        """Each master's value as ``"master"`` in ``optimizer.state_dict()``'s entry of its parameter."""
        for number, (_, master) in enumerate(self.pairs):  # state_dict numbers the params in group order, as here
            # A new entry: state_dict()'s entries are the optimizer's live per-parameter dicts.
            state["state"][number] = {**state["state"].get(number, {}), "master": master.detach().clone()}

    def load_from_state_dict(self, state: dict[str, Any]) -> None:
        """Pop the ``"master"`` entries of a loaded optimizer state into the masters and, rounded, the parameters;
        a master the state lacks starts from its (loaded) parameter."""
        for number, (p, master) in enumerate(self.pairs):
            value = state["state"].get(number, {}).pop("master", None)
            master.data.copy_(p.detach() if value is None else value)
            p.data.copy_(master.detach())

    def restore_dtype(self) -> None:
        """The parameters become the master values in the masters' dtype (after a fit that cast the module)."""
        for p, master in self.pairs:
            p.data = master.detach()


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` whose inf/NaN check covers every rank's gradients.

    ``unscale_`` looks at the optimizer's gradients only: under ZeRO this rank's shard. An overflow in another rank's
    shard would let this rank step and keep its scale while that rank skips and halves its own, and from then on the
    ranks would scale their losses differently. Here the found-inf flags are summed across ranks inside ``unscale_``
    (one scalar all-reduce per optimizer step), so every rank skips the same steps and updates the scale alike.
    """

    def __init__(self, device: str = "cuda", group: Any = None, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.group = group

    @classmethod
    def like(cls, scaler: torch.amp.GradScaler, group: Any = None) -> ShardedGradScaler:
        """A sharded scaler with ``scaler``'s settings and state (scale, growth tracker)."""
        sharded = cls(
            scaler._device,
            group=group,
            init_scale=scaler._init_scale,
            growth_factor=scaler._growth_factor,
            backoff_factor=scaler._backoff_factor,
            growth_interval=scaler._growth_interval,
            enabled=scaler._enabled,
        )
        if scaler._scale is not None:
            sharded.load_state_dict(scaler.state_dict())
        return sharded

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        found = sum(v.float().to(self._scale.device) for v in state["found_inf_per_device"].values())
        found = torch.as_tensor(found, dtype=torch.float32, device=self._scale.device).reshape(1)
        if comm.is_initialized() and comm.world_size(self.group) > 1:
            comm.all_reduce(found, "sum", group=self.group, tag="found_inf")
        # One entry carrying the global verdict: step() and update() read these values.
        state["found_inf_per_device"] = {self._scale.device: (found > 0).float()}
