"""``lightning-zero-ckpt``: look inside a checkpoint of our strategies, and make a sharded one plain, offline.

Runbook::

    lightning-zero-ckpt inspect outputs/runs/<time>/checkpoints/last.ckpt     # a DCP directory or one file
    lightning-zero-ckpt consolidate last.ckpt plain.ckpt
    lightning-zero-ckpt convert last.ckpt stage3.ckpt --stage 3
    lightning-zero-ckpt export last.ckpt model.safetensors

``inspect`` prints what a checkpoint holds without loading its tensors: the strategy and stage, the world size and
shard size it was written at, step and epoch, every tensor with its shape and dtype, the bytes each rank wrote, and
whether optimizer and scheduler state are present. ``consolidate`` turns any stage's sharded checkpoint into the one
file a ``full`` save would have written: ``torch.load`` and ``LightningModule.load_from_checkpoint`` read it without
lightning_zero, and its ``"optimizer_states"`` are in the format of the plain ``torch.optim`` optimizer, so
``optimizer.load_state_dict`` takes them and the optimizer steps as ours would have. ZeRO-1/2 keep each param group's
optimizer state as one flat tensor; it is cut back into per-parameter tensors by the names and order recorded at save
time ([Note: checkpoint info] in ``lightning_zero/zero/checkpointing.py``). ``convert`` writes any checkpoint as
another stage's sharded one (each tensor whole, so it loads at any world size); ``export`` writes the weights as
``.safetensors`` for other tools (``pip install "lightning-zero[safetensors]"``). All run in one process, no model
code needed; ``consolidate`` and ``convert`` hold the whole checkpoint in memory once.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_zero.zero.checkpoint import META_FILE, is_sharded_checkpoint, read_metadata
from lightning_zero.zero.checkpointing import INFO, MODEL, OPTIMIZERS, PARAM_GROUPS, SCHEDULERS


class CheckpointError(ValueError):
    """A checkpoint this tool cannot read or convert; the message names the file."""


# ---------------------------------------------------------------- reading
def _read_sharded(path: Path) -> dict[str, Any]:
    """Every tensor of a DCP directory, whole, in its nested dicts (``{"model": ..., "optimizer_0": ...}``)."""
    tensors: dict[str, Any] = {}
    _load_state_dict(
        tensors, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
    )
    return tensors


def _read_file(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except Exception as err:  # a truncated or foreign file: say which
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({type(err).__name__}: {err})") from None


def _info(checkpoint: dict[str, Any], path: Path) -> dict[str, Any]:
    info = checkpoint.get(INFO)
    if not isinstance(info, dict):
        raise CheckpointError(
            f"{path}: no {INFO!r} entry: written by another strategy, or by lightning_zero before checkpoints"
            " recorded their layout; load it with the strategy that wrote it and save it again"
        )
    return info


# ---------------------------------------------------------------- consolidate
def _elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, Tensor) and value.ndim == 1 and value.numel() == numel


def per_optimizer(info: dict[str, Any]) -> list[dict[str, Any]]:
    """[Note: checkpoint info] of each optimizer on its own: ``param_groups`` cut by ``groups_per_optimizer`` (a
    checkpoint without it has one optimizer)."""
    counts = info.get("groups_per_optimizer", [len(info["param_groups"])])
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [{**info, "param_groups": info["param_groups"][a : a + n]} for a, n in zip(starts, counts)]


def flat_groups(info: dict[str, Any]) -> list[list[str]]:
    """The trainable names of each param group in the order a stage-1/2 flat buffer lays them out (registration
    order)."""
    return [[name for name in info["trainable"] if name in members] for members in map(set, info["param_groups"])]


def _per_parameter(state: dict[str, Any], info: dict[str, Any], model: dict[str, Tensor]) -> dict[str, dict]:
    """``{parameter name: {key: value}}`` from a sharded optimizer state (stage 3: already per name; stages 1/2: one
    flat tensor per group, cut by :func:`flat_groups`)."""
    if info.get("stage") == 3:
        return dict(state)
    out: dict[str, dict] = {}
    for index, names in enumerate(flat_groups(info)):
        entry = state.get(f"group{index}", {})
        numel = sum(model[name].numel() for name in names)
        offset = 0
        for name in names:
            shape = model[name].shape
            out[name] = {
                key: value.narrow(0, offset, shape.numel()).reshape(shape).clone()
                if _elementwise(value, numel)
                else (value.clone() if isinstance(value, Tensor) else value)
                for key, value in entry.items()
            }
            offset += shape.numel()
    return {name: entry for name, entry in out.items() if entry}


def plain_optimizer_state(
    state: dict[str, Any], hyperparameters: list[dict], info: dict[str, Any], model: dict[str, Tensor]
) -> dict[str, Any]:
    """A sharded checkpoint's optimizer state in the unsharded ``torch.optim`` format: states numbered by each
    parameter's position across the user's param groups, as ``optimizer.state_dict()`` numbers them."""
    groups, number = [], {}
    for hyper, names in zip(hyperparameters, info["param_groups"]):
        numbers = list(range(len(number), len(number) + len(names)))
        number.update(zip(names, numbers))
        groups.append({**hyper, "params": numbers})
    per_param = _per_parameter(state, info, model)
    return {"state": {number[name]: per_param[name] for name in number if name in per_param}, "param_groups": groups}


def consolidate(src: str | Path) -> dict[str, Any]:
    """The checkpoint at ``src`` as one plain dict (the layout of a ``full`` save); ``src`` may be full already."""
    src = Path(src)
    if not is_sharded_checkpoint(src):
        return _read_file(src)
    meta = _read_file(src / META_FILE)
    info = _info(meta, src)
    tensors = _read_sharded(src)
    checkpoint = dict(meta)
    checkpoint[MODEL] = tensors.get("model", {})
    hyperparameters = checkpoint.pop(PARAM_GROUPS, [])
    if hyperparameters:
        checkpoint[OPTIMIZERS] = [
            plain_optimizer_state(tensors.get(f"optimizer_{k}", {}).get("state", {}), hyper, own, checkpoint[MODEL])
            for k, (hyper, own) in enumerate(zip(hyperparameters, per_optimizer(info)))
        ]
    checkpoint[INFO] = {**info, "sharded": False}
    return checkpoint


# ---------------------------------------------------------------- convert
def _sharded_optimizer_state(plain: dict[str, Any], info: dict[str, Any], stage: int) -> dict[str, Any]:
    """A plain optimizer state in ``stage``'s sharded layout, as whole tensors: keyed by parameter name (stage 3) or
    one flat tensor per param group (stages 1 and 2, :func:`flat_groups` order)."""
    names = [name for group in info["param_groups"] for name in group]
    by_name = {names[number]: entry for number, entry in plain["state"].items()}
    if stage == 3:
        return by_name
    state = {}
    for index, group in enumerate(flat_groups(info)):
        entries = [by_name.get(name) for name in group]
        if not any(entries):
            continue
        if not all(entries):
            missing = [name for name, entry in zip(group, entries) if not entry]
            raise CheckpointError(f"param group {index}: optimizer state for some parameters only (none for {missing})")
        flat = {}
        for key, first in entries[0].items():
            elementwise = isinstance(first, Tensor) and first.ndim > 0
            flat[key] = torch.cat([entry[key].reshape(-1) for entry in entries]) if elementwise else first
        state[f"group{index}"] = flat
    return state


def convert(src: str | Path, dst: str | Path, stage: int) -> None:
    """Write the checkpoint at ``src`` (any stage, sharded or full) as ``stage``'s sharded checkpoint at ``dst``.

    Each tensor is written whole (one DCP chunk), so the result loads at any world size: a rank reads the part it
    owns."""
    if stage not in (1, 2, 3):
        raise CheckpointError(f"--stage {stage} is invalid: expected 1, 2 or 3")
    checkpoint = consolidate(src)
    info = _info(checkpoint, Path(src))
    tensors: dict[str, Any] = {"model": checkpoint.pop(MODEL, {})}
    optimizers = checkpoint.pop(OPTIMIZERS, [])
    if optimizers:
        if "param_groups" not in info:
            raise CheckpointError(f"{src}: optimizer state without its parameter names (saved outside a fit)")
        for k, (plain, own) in enumerate(zip(optimizers, per_optimizer(info))):
            tensors[f"optimizer_{k}"] = {"state": _sharded_optimizer_state(plain, own, stage)}
        checkpoint[PARAM_GROUPS] = [
            [{k: v for k, v in g.items() if k != "params"} for g in plain["param_groups"]] for plain in optimizers
        ]
    checkpoint[INFO] = {**info, "stage": stage, "sharded": True}
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=False)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(tensors, storage_writer=FileSystemWriter(str(dst)), no_dist=True)
    torch.save(checkpoint, dst / META_FILE)


# ---------------------------------------------------------------- export
def export(src: str | Path, dst: str | Path) -> int:
    """The model weights of the checkpoint at ``src`` as a ``.safetensors`` file; returns the number of tensors.
    Tied weights (one tensor under two names) are written under both names, as ``state_dict()`` lists them."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError('export needs safetensors: pip install "lightning-zero[safetensors]"') from None
    state = consolidate(src)[MODEL]
    # safetensors refuses tensors sharing memory: each name gets its own contiguous copy.
    tensors = {name: value.detach().contiguous().clone() for name, value in state.items() if isinstance(value, Tensor)}
    save_file(tensors, str(dst), metadata={"source": str(src), "written_by": "lightning-zero-ckpt export"})
    return len(tensors)


# ---------------------------------------------------------------- inspect
def _size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError


def _tensor_rows(tensors: dict[str, tuple[tuple[int, ...], str]], prefix: str) -> list[str]:
    """One line per tensor, by name (a DCP index keeps no module order)."""
    return [f"  {name[len(prefix) :]}  {tuple(shape)}  {dtype}" for name, (shape, dtype) in sorted(tensors.items())]


def describe(path: str | Path) -> list[str]:
    """The lines ``inspect`` prints; reads the index and ``meta.pt`` of a directory, not its tensors."""
    path = Path(path)
    sharded = is_sharded_checkpoint(path)
    meta = _read_file(path / META_FILE if sharded else path)
    info = meta.get(INFO) if isinstance(meta.get(INFO), dict) else None
    lines = [f"{path}: {'sharded (DCP directory)' if sharded else 'one file'}"]
    if info is None:
        lines.append("strategy: not recorded (no 'lightning_zero' entry: another strategy, or an older lightning_zero)")
    else:
        stage = info.get("stage")
        strategy = f"zero{stage}_scratch (stage {stage})" if stage else "ZeRO, written outside a fit (whole model)"
        shard = info.get("shard_size")
        hybrid = f", sharded over groups of {shard}" if shard and shard != info["world_size"] else ""
        lines.append(f"strategy: {strategy}, written by {info['world_size']} rank(s){hybrid}")
    lines.append(f"step {meta.get('global_step', '-')}, epoch {meta.get('epoch', '-')}")
    if sharded:
        index = read_metadata(path).state_dict_metadata
        shapes = {
            fqn: (tuple(item.size), str(item.properties.dtype).removeprefix("torch."))
            for fqn, item in index.items()
            if isinstance(item, TensorStorageMetadata)
        }
        model = {k: v for k, v in shapes.items() if k.startswith("model.")}
        has_optimizer = any(k.startswith("optimizer_0.") for k in index) or bool(meta.get(PARAM_GROUPS))
        per_rank: dict[str, int] = {}
        for file in sorted(path.glob("*.distcp")):
            rank = file.name.removeprefix("__").split("_")[0]
            per_rank[rank] = per_rank.get(rank, 0) + file.stat().st_size
        written = ", ".join(f"rank {r}: {_size(b)}" for r, b in sorted(per_rank.items(), key=lambda kv: int(kv[0])))
        lines.append(f"tensor data written per rank: {written}")
    else:
        state = meta.get(MODEL, {})
        model = {
            f"model.{k}": (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in state.items()
            if isinstance(v, Tensor)
        }
        has_optimizer = bool(meta.get(OPTIMIZERS))
        lines.append(f"file size: {_size(path.stat().st_size)} (written by rank 0)")
    numel = sum(torch.Size(shape).numel() for shape, _ in model.values())
    lines.append(f"model: {len(model)} tensors, {numel:,} elements")
    lines += _tensor_rows(model, "model.")
    lines.append(f"optimizer state: {'yes' if has_optimizer else 'no'}")
    lines.append(f"lr schedulers: {len(meta.get(SCHEDULERS, []))}")
    return lines


# ---------------------------------------------------------------- console script
def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``lightning-zero-ckpt``."""
    parser = argparse.ArgumentParser(prog="lightning-zero-ckpt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="print what a checkpoint holds")
    inspect.add_argument("path", help="a sharded checkpoint directory or a checkpoint file")
    merge = commands.add_parser("consolidate", help="a sharded checkpoint as one plain file")
    merge.add_argument("src", help="a sharded checkpoint directory")
    merge.add_argument("dst", help="the file to write")
    change = commands.add_parser("convert", help="a checkpoint as another stage's sharded checkpoint")
    change.add_argument("src", help="a checkpoint of any stage, sharded or full")
    change.add_argument("dst", help="the directory to write (must not exist)")
    change.add_argument("--stage", type=int, required=True, help="1, 2 or 3")
    weights = commands.add_parser("export", help="the model weights as a .safetensors file")
    weights.add_argument("src", help="a checkpoint of any stage, sharded or full")
    weights.add_argument("dst", help="the .safetensors file to write")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print("\n".join(describe(args.path)))
        elif args.command == "convert":
            convert(args.src, args.dst, args.stage)
            print(
                f"wrote {args.dst}: a stage-{args.stage} sharded checkpoint (loads at any world size)", file=sys.stderr
            )
        elif args.command == "export":
            print(f"wrote {args.dst}: {export(args.src, args.dst)} tensors", file=sys.stderr)
        else:
            checkpoint = consolidate(args.src)
            torch.save(checkpoint, args.dst)
            print(f"wrote {args.dst}: {len(checkpoint.get(MODEL, {}))} model tensors", file=sys.stderr)
    except (CheckpointError, FileNotFoundError, FileExistsError) as err:
        parser.exit(2, f"lightning-zero-ckpt: {err}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
