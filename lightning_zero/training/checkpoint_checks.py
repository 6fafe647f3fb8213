"""Refusing a bad checkpoint with one error that names the file and the tensor, before any weight changes.

A resume can meet a file truncated by a full disk, a sharded checkpoint with a shard missing or cut short (a save
killed half-way, a copy that stopped), a checkpoint of another model, or one written by a newer lightning_zero. The
errors torch gives for these name neither the file nor the tensor (``PytorchStreamReader failed reading zip archive:
failed finding central directory``), and ``nn.Module.load_state_dict`` copies every matching tensor before it reports
a size mismatch, so a refused resume has already changed the weights. Every strategy of ours reads through
:func:`reading` and checks shapes with :func:`check_shapes` before loading; sharded checkpoints are verified file by
file against their index first (``lightning_zero/zero/checkpoint.py``).
"""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: the message names the file and, where one is at fault, the tensor."""


@contextmanager
def reading(path: str | Path, what: str = "checkpoint") -> Generator[None, None, None]:
    """Turn the errors of reading ``path`` (truncated, corrupt, not a checkpoint) into one :class:`CheckpointError`."""
    try:
        yield
    except FileNotFoundError as error:
        raise CheckpointError(f"{what} {path} does not exist ({error.filename})") from error
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(
            f"cannot read {what} {path}: {type(error).__name__}: {error} (truncated, corrupt, or not a checkpoint)"
        ) from error


def shapes_of(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in ``state`` (a state dict)."""
    return {name: tuple(value.shape) for name, value in state.items() if hasattr(value, "shape")}


def check_shapes(path: str | Path, saved: Mapping[str, Any], model: Mapping[str, Any]) -> None:
    """Refuse a checkpoint whose tensors (``saved``: name to shape) differ in shape from the model's (``model``)."""
    wrong = [(name, tuple(shape), tuple(model[name])) for name, shape in saved.items() if name in model]
    wrong = [w for w in wrong if w[1] != w[2]]
    if wrong:
        name, there, here = wrong[0]
        more = f" (and {len(wrong) - 1} more: {[w[0] for w in wrong[1:4]]})" if len(wrong) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path} is of another model: tensor {name!r} has shape {there} there, but {here} in the"
            f" model{more}; nothing was loaded"
        )


def check_format(path: str | Path, info: Mapping[str, Any], supported: int) -> None:
    """Refuse a checkpoint written in a newer layout than this version of lightning_zero reads."""
    written = info.get("format", supported)
    if not isinstance(written, int) or written > supported:
        raise CheckpointError(
            f"checkpoint {path} has lightning_zero format {written!r}, but this version reads formats up to"
            f" {supported}: upgrade lightning_zero, or consolidate it with the version that wrote it"
            " (lightning-zero-ckpt consolidate)"
        )
