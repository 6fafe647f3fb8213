"""Parameters changed in place outside the optimizer, which ZeRO cannot follow: found and refused by name.

[Note: parameters changed in place] Under ``ddp`` every rank holds its own copy of each parameter, so an in-place
write to a parameter outside the optimizer stays on the rank that made it: ``nn.Embedding(max_norm=...)`` renormalises
the rows each rank looked up, and each rank keeps its own result (the ranks then differ). ZeRO holds one value of each
parameter across the ranks, owned piece by piece, so no ZeRO stage can do that:

- stages 1 and 2: the write lands in the module's full copy, and the all-gather after the next optimizer step
  replaces it with the owners' values (and a master copy under mixed precision never sees it);
- stage 3: the write lands in the gathered copy, which is dropped when the unit is freed (between steps, a parameter
  is a placeholder that cannot be written at all).

So a ZeRO strategy refuses it: at setup for the modules known to write their weights in forward (an embedding with
``max_norm``), and otherwise at the first training step that made one, by the version counter that every in-place
operation on a tensor bumps (``p._version``; the engines write through other tensors, so theirs do not count). The
check compares the counters at the start and at the end of every training step: a change inside names the step, a
change between two steps names the hooks and callbacks that run there. A write through ``p.data`` bumps no counter
and is not seen (as torch's own autograd does not see it).
"""

from __future__ import annotations

from torch import nn

_ADVICE = (
    " ZeRO keeps one value of each parameter across the ranks, so it cannot keep what one rank wrote into its own copy"
    " (under ddp each rank keeps its own, and the ranks then differ). Use ddp_scratch, which keeps the copies as ddp"
    " does, or leave the parameter to the optimizer ([Note: parameters changed in place] in"
    " lightning_zero/zero/inplace.py)."
)


def check_renorming_modules(module: nn.Module, strategy: str) -> None:
    """Refuse the modules that renormalise their weight in place in every forward (``nn.Embedding`` and
    ``nn.EmbeddingBag`` with ``max_norm``), naming them."""
    found = [
        f"{name or type(module).__name__} ({type(m).__name__}, max_norm={m.max_norm})"
        for name, m in module.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None
    ]
    if found:
        raise ValueError(
            f"{strategy} cannot train {found}: with max_norm the embedding renormalises the rows it looks up in place"
            " in every forward, each rank its own rows." + _ADVICE + " Or drop max_norm and normalise the looked-up"
            " vectors in forward (F.normalize), which changes no parameter."
        )


class ParamVersions:
    """The version counters of a module's parameters, to find the ones written in place between two points."""

    def __init__(self, module: nn.Module, strategy: str) -> None:
        self._named = list(module.named_parameters())
        self._owners = {id(p): name.rpartition(".")[0] for name, p in self._named}
        self._types = {name: type(m).__name__ for name, m in module.named_modules()}
        self._strategy = strategy
        self._versions = self._read()

    def _read(self) -> list[int]:
        return [p._version for _, p in self._named]

    def check(self, where: str) -> None:
        """Raise if a parameter was written in place since the last check (``where``: what ran in between)."""
        now = self._read()
        changed = [(name, p) for (name, p), old, new in zip(self._named, self._versions, now) if old != new]
        self._versions = now
        if changed:
            owners = {self._owners[id(p)] for _, p in changed}
            modules = sorted(f"{owner or '<root>'} ({self._types[owner]})" for owner in owners)
            raise RuntimeError(
                f"{self._strategy}: {[name for name, _ in changed]} changed in place {where}, outside the optimizer"
                f" (their modules: {modules})." + _ADVICE
            )

    def reset(self) -> None:
        """Forget writes made so far (ours: loading a checkpoint copies into the parameters)."""
        self._versions = self._read()
