"""Tensor parallelism: ``lightning_zero.tensor_parallel`` against DTensor's ``parallelize_module``, same plan.

Runbook::

    torchrun --nproc_per_node 2 benchmarks/tensor_parallel.py                   # the demo GPT, 6 x 512, vocab 8192
    torchrun --nproc_per_node 2 benchmarks/tensor_parallel.py --layers 1 --width 64 --vocab 256 --steps 3   # smoke

Both sides start from one ``CharGPT`` (``lightning_zero/demo/model.py``, seed 0) and apply Megatron's plan over all
ranks: vocabulary-parallel token embedding, column-parallel fused q/k/v (each rank its heads) and MLP input,
row-parallel attention output and MLP output, column-parallel LM head with the logits left vocabulary-sharded and a
vocabulary-parallel cross entropy; position embedding and LayerNorms replicated.

- ``lightning_zero``: ``parallelize(model, GPT_PLAN)`` and ``vocab_parallel_cross_entropy``;
- ``dtensor``: ``torch.distributed.tensor.parallel.parallelize_module`` with ``RowwiseParallel`` (embedding),
  ``ColwiseParallel`` / ``RowwiseParallel`` (blocks), ``ColwiseParallel(output_layouts=Shard(-1))`` (head) and
  ``loss_parallel()``. DTensor shards a fused q/k/v weight in plain row blocks, so its rows are first permuted to
  ``[q_0 k_0 v_0 | q_1 k_1 v_1]`` (rank r's heads together): the same arithmetic as ours, and the block's ``n_head``
  is divided by the group size on both sides.

A step is forward, backward and ``AdamW.step`` on ``--batch`` sequences of the full context, interleaved (A B A B
...) after ``--warmup`` untimed steps; a step's time is the slowest rank's. The table gives medians, the ratio, each
side's first loss (they must agree) and the model-state bytes per rank (parameters, gradients and AdamW state, the
local shards of DTensors). Loopback gloo on 2 cores is noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from lightning_zero.demo.model import CharGPT
from lightning_zero.tensor_parallel import GPT_PLAN, parallelize, vocab_parallel_cross_entropy


def interleave_qkv(model: CharGPT, size: int) -> None:
    """Reorder each fused q/k/v projection's rows so that row block r (DTensor's Shard(0)) holds rank r's heads."""
    for block in model.blocks:
        with torch.no_grad():
            for tensor in (block.qkv.weight, block.qkv.bias):
                q, k, v = (part.chunk(size) for part in tensor.chunk(3))
                tensor.copy_(torch.cat([torch.cat([q[r], k[r], v[r]]) for r in range(size)]))


def dtensor_model(model: CharGPT, size: int) -> CharGPT:
    interleave_qkv(model, size)
    mesh = init_device_mesh("cpu", (size,))
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate()),
        "blocks.*.qkv": ColwiseParallel(),
        "blocks.*.proj": RowwiseParallel(),
        "blocks.*.mlp.0": ColwiseParallel(),
        "blocks.*.mlp.2": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for block in model.blocks:
        block.n_head //= size
    return parallelize_module(model, mesh, plan)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    def local(t: Tensor) -> Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def runner(name: str, model: CharGPT, x: Tensor, y: Tensor) -> tuple[Callable[[], float], torch.optim.Optimizer]:
    # for-loop AdamW on both sides: foreach refuses a mix of DTensor and plain (replicated) parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step() -> float:
        logits = model(x)
        if name == "dtensor":
            with loss_parallel():
                loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
                loss.backward()
            value = loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item()
        else:
            loss = vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            value = loss.item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return value

    return step, optimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = CharGPT(args.vocab, args.context, args.layers, args.heads, args.width, dropout=0.0)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=generator)
    x, y = tokens[:, :-1], tokens[:, 1:]
    models = {"lightning_zero": parallelize(copy.deepcopy(base), GPT_PLAN), "dtensor": dtensor_model(base, size)}
    runners = {name: runner(name, model, x, y) for name, model in models.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    first: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        for name, (run, _) in runners.items():
            dist.barrier()
            start = time.perf_counter()
            loss = run()
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            first.setdefault(name, loss)
            if step >= args.warmup:
                times[name].append(elapsed.item())
    if rank == 0:
        print(
            f"{size} ranks, CharGPT {args.layers} x {args.width}, {args.heads} heads, vocab {args.vocab},"
            f" {args.batch} x {args.context} tokens, {args.steps} steps"
        )
        print(f"{'candidate':>15} {'median ms':>10} {'vs dtensor':>10} {'first loss':>11} {'model state MiB':>16}")
    reference = statistics.median(times["dtensor"])
    for name, (_, optimizer) in runners.items():
        nbytes = model_state_bytes(models[name], optimizer)
        if rank == 0:
            median = statistics.median(times[name])
            print(
                f"{name:>15} {median * 1e3:10.1f} {median / reference:10.3f} {first[name]:11.5f} {nbytes / 2**20:16.1f}"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
