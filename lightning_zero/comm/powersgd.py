"""PowerSGD gradient compression (Vogels et al., 2019) for the persistent gradient buckets of ``ddp_scratch``.

Runbook::

    ScratchDDPStrategy(grad_compression="powersgd", powersgd={"rank": 2, "start_iter": 100})
    # or by hand, on a persistent GradientReducer:
    compressor = PowerSGDCompressor(PowerSGDConfig(rank=2, start_iter=100))
    reducer = GradientReducer.for_module(module, bucket_cap_bytes=25 * 2**20, compressor=compressor)

The arithmetic is that of torch's ``powerSGD_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py``,
``batch_tensors_with_same_shape=False``), written again on :mod:`lightning_zero.comm.collectives`; the test suite
checks it against that hook (``tests/comm/test_powersgd.py``). Nothing here imports the hook.

[Note: PowerSGD, one bucket]
Tensor roles, for one bucket of gradients ``g`` (this rank's, averaged over nothing yet):

- *error* ``e`` (error feedback, one per bucket, the bucket's size, this rank's own): what compression dropped from
  this rank's gradient on the previous compressed step. It is added to the bucket first (``g + e``), and after the
  step it is ``(g + e) - result`` over the *whole* bucket, uncompressed tensors included (torch does the same; their
  errors sum to zero over the ranks).
- *matrix* ``M`` (a view of one member of the bucket, ``n x m`` with ``n = shape[0]``): the tensors worth
  compressing (:func:`plan_tensors`); the rest (biases, norms, small or square-ish tensors) are all-reduced as one
  flat *uncompressed* tensor, summed and divided by the world size.
- *P* (``n x r``) and *Q* (``m x r``), ``r = min(n, m, rank)``: one flat P memory and one flat Q memory per bucket,
  the tensors' factors laid out in groups of equal ``(n, m)`` (in order of first appearance), as torch lays them out.

One step: ``Q`` is this bucket's Q of the last step (warm start; orthogonalised again) or, on the first compressed step
or without warm start, random normal from ``torch.manual_seed(rng.randint(1_000_000_000))`` (``rng`` a
``numpy.random.RandomState(seed)`` shared by all buckets, one draw per bucket that needs it) and orthogonalised;
``P = M Q``; all-reduce (sum) the uncompressed tensors, then P; orthogonalise P; ``Q = Mᵀ P``; all-reduce (sum) Q and
divide it by the world size; ``M <- P Qᵀ``, which is the average over the ranks of the rank-``r`` approximations.
Orthogonalisation: Gram-Schmidt over the columns for ``r <= 2`` or half-precision buckets, else ``torch.linalg.qr``.
Everything is computed and communicated in the bucket's dtype (fp32 under every precision but ``-true`` without
master weights), whatever ``reduce_dtype`` says: the strategies refuse an explicit one.

Bytes per compressed step and bucket (what the ledger records): ``sum over compressed (n + m) * r * b`` for P and Q
plus ``numel(uncompressed) * b`` (``b`` the bucket's element size), tags ``"<tag>_powersgd_p"``, ``"_q"`` and
``"_uncompressed"``; an uncompressed step is the plain bucket all-reduce (``numel * b``, tag ``"<tag>"``).

Iterations count synchronised backward passes (one per optimizer step; micro-batches inside ``no_sync`` count nothing),
advanced after the last bucket of a pass: iterations ``0 .. start_iter - 1`` use the plain all-reduce, as torch's
``start_powerSGD_iter``. Where this differs from torch's hook, on purpose:

- ``start_iter`` may be 0 or 1 with error feedback or warm start (torch refuses: its DDP rebuilds buckets after the
  first iteration; ours never do).
- An all-zero column is left at zero by Gram-Schmidt with ``orthogonalization_epsilon=0`` (torch divides by the zero
  norm and gets NaN; its code means to fill zeros). Identical whenever every norm is non-zero.
- A step whose all-reduced P, Q or uncompressed values are not finite (a ``16-mixed`` loss-scale overflow on some rank)
  keeps the error of the step before and drops the bucket's Q memory, so the loss scaler skips that step on every
  rank and the next step starts clean (torch's error and Q memories would hold NaN for good). The decision is the
  same on every rank: it reads all-reduced values.
- Tensors with no elements or no dimensions (a scalar parameter) are never compressed (torch cannot view them as a
  matrix).

Everything runs synchronously inside the bucket's launch, on the autograd thread: a compressed bucket does not overlap
with the rest of backward (correct first; the plain steps before ``start_iter`` still overlap).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.powersgd_config import PowerSGDConfig

CHECKPOINT_KEY = "powersgd_compressor"
"""The checkpoint entry holding :meth:`PowerSGDCompressor.state_dict` (every rank's error feedback and Q memory)."""


# ----------------------------------------------------------------------------------------------- pure math
@dataclass(frozen=True)
class TensorPlan:
    """What happens to one member of a bucket: viewed as an ``n x m`` matrix, compressed at rank ``r`` or not."""

    n: int
    m: int
    r: int
    compress: bool

    @property
    def numel(self) -> int:
        return self.n * self.m

    @property
    def sent_numel(self) -> int:
        """Elements this tensor contributes to a compressed step's all-reduces: ``(n + m) r`` or ``n m``."""
        return (self.n + self.m) * self.r if self.compress else self.numel


def plan_tensors(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float) -> list[TensorPlan]:
    """Which tensors of a bucket are worth compressing, torch's rule: a tensor of shape ``(n, ...)`` is the matrix
    ``n x m`` (``m`` the product of the other dimensions); with ``r = min(n, m, rank)`` it is compressed when
    ``(n + m) * r * min_compression_rate < n * m``. Vectors (``m = 1``) never pass for a rate >= 1. Scalars and empty
    tensors are never compressed."""
    plans = []
    for shape in shapes:
        numel = math.prod(shape)
        if len(shape) == 0 or numel == 0:
            plans.append(TensorPlan(1, numel, 0, False))
            continue
        n = shape[0]
        m = numel // n
        r = min(n, m, rank)
        plans.append(TensorPlan(n, m, r, (n + m) * r * min_compression_rate < n * m))
    return plans


def compressed_step_bytes(shapes: Sequence[Sequence[int]], config: PowerSGDConfig, element_size: int = 4) -> int:
    """Bytes one rank contributes to one compressed step of a bucket with members of ``shapes``."""
    return sum(p.sent_numel for p in plan_tensors(shapes, config.rank, config.min_compression_rate)) * element_size


def factor_order(plans: Sequence[TensorPlan]) -> list[int]:
    """Indices of the compressed tensors in the order their P and Q factors are laid out: grouped by ``(n, m)``, the
    groups in order of first appearance (torch's ``shape_to_tensors``)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, plan in enumerate(plans):
        if plan.compress:
            groups.setdefault((plan.n, plan.m), []).append(i)
    return [i for members in groups.values() for i in members]


def orthogonalize(matrices: Tensor, epsilon: float = 0.0) -> None:
    """Orthonormalise the columns of each ``(batch, rows, r)`` matrix in place, as torch's PowerSGD does:
    Gram-Schmidt for ``r <= 2`` or half precision, else ``torch.linalg.qr``. An all-zero column stays zero."""
    if matrices.ndim != 3 or matrices.shape[2] > matrices.shape[1]:
        raise ValueError(f"orthogonalize takes (batch, rows, r) with r <= rows: got shape {tuple(matrices.shape)}")
    r = matrices.shape[2]
    if r > 2 and matrices.dtype not in (torch.float16, torch.bfloat16):
        q = torch.empty(matrices.shape[0], r, r, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, q))
        return
    for i in range(r):
        col = matrices[:, :, i : i + 1]
        norm = torch.norm(col, dim=1, keepdim=True)
        if epsilon == 0:
            col /= torch.where(norm == 0, torch.ones_like(norm), norm)  # 0 / 1: a zero column stays zero
        else:
            col /= norm + epsilon
        if i + 1 < r:
            rest = matrices[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


# ----------------------------------------------------------------------------------------------- the compressor
class PowerSGDCompressor:
    """PowerSGD for the buckets of one :class:`~lightning_zero.dp.reducer.GradientReducer` ([Note: PowerSGD, one
    bucket]): the iteration counter, the seed generator and, per bucket index, the error feedback and Q memory.

    The reducer asks :attr:`compressing` before launching a bucket, calls :meth:`all_reduce` for it when it is, and
    :meth:`end_iteration` after the last bucket of each synchronised pass.

    Args:
        config: the settings.
        group: process group (``None``: the default group).
        tag: ledger tag prefix of the all-reduces (``"<tag>_powersgd_p"``, ...).
    """

    def __init__(self, config: PowerSGDConfig, *, group: Any = None, tag: str = "grads") -> None:
        self.config, self.group, self.tag = config, group, tag
        self.iteration = 0
        self._rng = np.random.RandomState(config.seed)
        self._errors: dict[int, Tensor] = {}  # bucket index -> this rank's error feedback (the bucket's size)
        self._qs: dict[int, Tensor] = {}  # bucket index -> flat Q memory of the last step (warm start)

    @property
    def compressing(self) -> bool:
        """Whether the current pass compresses (``iteration >= start_iter``)."""
        return self.iteration >= self.config.start_iter

    def end_iteration(self) -> None:
        """The last bucket of a synchronised pass was launched."""
        self.iteration += 1

    @property
    def buffers(self) -> list[Tensor]:
        """The persistent tensors: every bucket's error feedback and Q memory."""
        return [*self._errors.values(), *self._qs.values()]

    def reset_buckets(self) -> None:
        """The reducer's buckets changed (parameters unfrozen during a fit): the per-bucket memories no longer fit
        and start again; the iteration count and the seed generator go on."""
        self._errors.clear()
        self._qs.clear()

    def all_reduce(self, index: int, buffer: Tensor, members: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Replace the flat bucket ``buffer`` by its compressed average over the group, synchronously.

        Args:
            index: the bucket's index (the key of its error feedback and Q memory).
            buffer: the bucket, flat; its values are this rank's gradients.
            members: ``(offset, shape)`` of each tensor in the bucket, in the order of their offsets.
        """
        config, dtype, device = self.config, buffer.dtype, buffer.device
        world = comm.world_size(self.group)
        previous_error = self._errors.get(index)
        if config.error_feedback:
            if previous_error is not None:
                self._check_size("error feedback", index, previous_error.numel(), buffer.numel())
                if previous_error.device != device or previous_error.dtype != dtype:  # loaded from a checkpoint
                    previous_error = previous_error.to(device=device, dtype=dtype)
                buffer.add_(previous_error)
            before = buffer.clone()  # g + e: the next error is what the result leaves of it

        tensors = [buffer.narrow(0, offset, math.prod(shape)) for offset, shape in members]
        plans = plan_tensors([shape for _, shape in members], config.rank, config.min_compression_rate)
        uncompressed = [t for t, plan in zip(tensors, plans) if not plan.compress]
        order = factor_order(plans)
        matrices = [tensors[i].view(1, plans[i].n, plans[i].m) for i in order]
        p_numel = sum(plans[i].n * plans[i].r for i in order)
        q_numel = sum(plans[i].m * plans[i].r for i in order)

        q_memory = self._qs.get(index) if config.warm_start else None
        if q_memory is not None:
            self._check_size("Q memory", index, q_memory.numel(), q_numel)
            q_memory = q_memory.to(device=device, dtype=dtype)
        fresh = q_memory is None
        if q_memory is None:
            q_memory = torch.empty(q_numel, dtype=dtype, device=device)
        p_memory = torch.empty(p_numel, dtype=dtype, device=device)
        ps, qs, p_at, q_at = [], [], 0, 0
        for i in order:
            n, m, r = plans[i].n, plans[i].m, plans[i].r
            ps.append(p_memory.narrow(0, p_at, n * r).view(1, n, r))
            qs.append(q_memory.narrow(0, q_at, m * r).view(1, m, r))
            p_at, q_at = p_at + n * r, q_at + m * r

        if fresh:
            # The same seed on every rank (one draw per bucket that needs it); the global generators untouched.
            # Drawn on the CPU and copied, as torch does, so CPU and CUDA runs start from the same Q.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self._rng.randint(1_000_000_000))
                for q in qs:
                    q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype))
                    orthogonalize(q, config.orthogonalization_epsilon)
        else:
            for q in qs:
                orthogonalize(q, config.orthogonalization_epsilon)

        for matrix, q, p in zip(matrices, qs, ps):
            torch.bmm(matrix, q, out=p)
        flat_uncompressed = torch.cat([t.view(-1) for t in uncompressed]) if uncompressed else None
        if flat_uncompressed is not None:
            comm.all_reduce(flat_uncompressed, "sum", group=self.group, tag=f"{self.tag}_powersgd_uncompressed")
            flat_uncompressed.div_(world)
            at = 0
            for t in uncompressed:
                t.copy_(flat_uncompressed.narrow(0, at, t.numel()))
                at += t.numel()
        if order:
            # P is orthogonalised after the sum, so it needs no division by the world size.
            comm.all_reduce(p_memory, "sum", group=self.group, tag=f"{self.tag}_powersgd_p")
            for p in ps:
                orthogonalize(p, config.orthogonalization_epsilon)
            for matrix, p, q in zip(matrices, ps, qs):
                torch.bmm(matrix.transpose(1, 2), p, out=q)
            comm.all_reduce(q_memory, "sum", group=self.group, tag=f"{self.tag}_powersgd_q")
            q_memory.div_(world)
            for p, q, matrix in zip(ps, qs, matrices):
                torch.bmm(p, q.transpose(1, 2), out=matrix)

        reduced = [t for t in (flat_uncompressed, p_memory, q_memory) if t is not None]
        if not all(bool(torch.isfinite(t).all()) for t in reduced):
            # An overflow on some rank: the same verdict everywhere (all-reduced values). Keep the last error, start
            # Q afresh; the buffer holds the non-finite average, so the loss scaler skips the step.
            self._qs.pop(index, None)
            return
        if config.error_feedback:
            self._errors[index] = before.sub_(buffer)
        if config.warm_start:
            self._qs[index] = q_memory

    @staticmethod
    def _check_size(what: str, index: int, saved: int, expected: int) -> None:
        if saved != expected:
            raise ValueError(
                f"the PowerSGD {what} of bucket {index} has {saved} elements, but this bucket needs {expected}: resume"
                " with the same model, bucket_size_mb and powersgd rank/min_compression_rate as the checkpoint"
            )

    # ------------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The iteration, the seed generator's state and every rank's error feedback and Q memory (on the CPU, one
        row per rank). A collective: every rank must call it, in the same order."""
        world = comm.world_size(self.group)
        buckets: dict[int, dict[str, Tensor | None]] = {}
        for index in sorted(set(self._errors) | set(self._qs)):
            entry: dict[str, Tensor | None] = {}
            for name, store in (("error", self._errors), ("q", self._qs)):
                tensor = store.get(index)
                if tensor is None:
                    entry[name] = None
                    continue
                rows = tensor.new_empty(world * tensor.numel())
                if tensor.numel() > 0:  # a bucket with nothing to compress keeps an empty Q memory
                    comm.all_gather(rows, tensor.view(-1), group=self.group, tag="checkpoint")
                entry[name] = rows.view(world, tensor.numel()).cpu().clone()
            buckets[index] = entry
        generator = self._rng.get_state(legacy=False)  # the legacy tuple's values, typed in numpy's stubs
        rng = {
            "keys": torch.from_numpy(generator["state"]["key"].astype(np.int64)),
            "pos": int(generator["state"]["pos"]),
            "has_gauss": int(generator["has_gauss"]),
            "cached_gaussian": float(generator["gauss"]),
        }
        return {"iteration": self.iteration, "world_size": world, "rng": rng, "buckets": buckets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """This rank's rows of :meth:`state_dict`'s output (moved to the buckets' device when first used)."""
        world = comm.world_size(self.group)
        if state["world_size"] != world:
            raise ValueError(
                f"the checkpoint's PowerSGD state is for world_size={state['world_size']}, this run has"
                f" world_size={world}: resume with as many processes (the error feedback is per rank)"
            )
        me = comm.rank(self.group)
        self.iteration = int(state["iteration"])
        rng = state["rng"]
        self._rng.set_state(
            ("MT19937", rng["keys"].numpy().astype(np.uint32), rng["pos"], rng["has_gauss"], rng["cached_gaussian"])
        )
        self.reset_buckets()
        for index, entry in state["buckets"].items():
            if entry.get("error") is not None:
                self._errors[int(index)] = entry["error"][me].clone()
            if entry.get("q") is not None:
                self._qs[int(index)] = entry["q"][me].clone()
