"""``tensor_parallel_scratch`` on the demo ``CharGPTModule`` against a plain single-process PyTorch loop.

The reference replays what Lightning does with ``R`` data replicas (``tests/helpers/parity.py``'s pattern): step
``k``'s global batch is the union of every replica's ``k``-th batch of a shuffling ``DistributedSampler(num_replicas=R,
rank=r, seed)``, the loss the mean of the replicas' mean losses, divided by ``accumulate_grad_batches``, then
``clip_grad_norm_`` and AdamW. AdamW runs with ``eps=1e-4``: some gradients are zero in exact arithmetic (the key bias)
and Adam would turn their rounding noise, which differs with the summation order, into full-size steps (see
``_adamw`` in ``tests/tensor_parallel/test_plan.py``). The learning rate is constant (``warmup_steps=0``,
``min_lr_ratio=1``).

Ledger of one micro-batch (Shoeybi et al. 2019, section 3; ``tests/tensor_parallel/test_plan.py``): per block two
activation all-reduces forward and two backward, plus the vocabulary-parallel embedding's forward one, the head's
backward one and the loss's three: ``4 * layers + 5`` all-reduces tagged ``"tp"``.

``zero_stage`` 1 and 2 ([Note: ZeRO x tensor parallel]) run the same fit with the optimizer state (and stage 2's
gradients) sharded over the 2 replicas: the reference is the same; the ledger adds the ZeRO engine's parameter
all-gathers (``"params"``, one per optimizer param group and step) and the norm's data-parallel all-reduce
(``"grad_norm"``), and the optimizer state per rank halves.
"""

from __future__ import annotations

import os
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_zero
from lightning_zero.comm import collectives as comm
from lightning_zero.demo.model import CharGPT, CharGPTModule
from lightning_zero.tensor_parallel import GPT_PLAN, ColwiseParallel
from lightning_zero.zero.checkpoint import read_meta, read_metadata
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer
from tests.helpers.parity import max_abs_diff, quiet_trainer
from tests.helpers.workers import run_workers

VOCAB, BLOCK, LAYERS, HEADS, EMBD = 16, 8, 2, 4, 16
BATCH, BATCHES, EPOCHS, SEED, LR, CLIP = 4, 4, 2, 7, 3e-3, 0.5
PARAM_GROUPS = 2  # decay and no decay (CharGPTModule.configure_optimizers)
TP_PER_MICRO_BATCH = 4 * LAYERS + 5
TP_BYTES_PER_MICRO_BATCH = (4 * LAYERS + 2) * BATCH * BLOCK * EMBD * 4 + 3 * BATCH * BLOCK * 4  # activations + loss
TOLERANCE = 1e-5


def make_dataset(replicas: int) -> TensorDataset:
    """One sample short of full batches: the sampler pads (repeats) one index whenever ``replicas > 1``."""
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (replicas * BATCH * BATCHES - 1, BLOCK + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def make_net() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(VOCAB, BLOCK, LAYERS, HEADS, EMBD, dropout=0.0)


def _adamw(groups: list[dict]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=LR, eps=1e-4)


def make_module(cls: type[CharGPTModule] = CharGPTModule) -> CharGPTModule:
    """The module with :func:`make_net`'s weights (built here, so ``configure_model`` keeps them)."""
    module = cls(VOCAB, BLOCK, LAYERS, HEADS, EMBD, 0.0, optimizer=_adamw, warmup_steps=0, min_lr_ratio=1.0)
    module.net = make_net()
    return module


def reference(replicas: int, accumulate: int, clip: float | None, epochs: int = EPOCHS) -> dict:
    """The plain PyTorch run (module docstring): final weights, each replica's loss per step, the gradient norm of
    each optimizer step (before clipping) and the optimizer's final state dict."""
    dataset, net = make_dataset(replicas), make_net()
    decay = [p for p in net.parameters() if p.ndim >= 2]
    optimizer = _adamw([{"params": decay}, {"params": [p for p in net.parameters() if p.ndim < 2], "weight_decay": 0}])
    replica_losses: list[list[float]] = [[] for _ in range(replicas)]
    norms = []
    for epoch in range(epochs):
        per_replica = []
        for r in range(replicas):
            sampler = DistributedSampler(dataset, num_replicas=replicas, rank=r, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            per_replica.append(list(sampler))
        n_batches = -(-len(per_replica[0]) // BATCH)
        for k in range(n_batches):
            losses = []
            for r, indices in enumerate(per_replica):
                x, y = dataset[indices[k * BATCH : (k + 1) * BATCH]]
                losses.append(F.cross_entropy(net(x).flatten(0, 1), y.flatten()))
                replica_losses[r].append(losses[-1].item())
            (torch.stack(losses).mean() / accumulate).backward()
            if (k + 1) % accumulate == 0 or k + 1 == n_batches:
                if clip is not None:
                    norms.append(nn.utils.clip_grad_norm_(net.parameters(), clip).item())
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    weights = {k: v.detach().clone() for k, v in net.state_dict().items()}
    return {"weights": weights, "losses": replica_losses, "norms": norms, "optimizer": optimizer.state_dict()}


class Recorder(L.Callback):
    """Each training batch's logged loss and what it communicated, and the model-state bytes after the last one (the
    ZeRO engine's gradient pool apart)."""

    TAGS = ("grads", "tp", "tp/grad_norm", "grad_norm")

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.ledger: list[dict[str, int]] = []
        self.memory: dict[str, int] = {}
        self.validated: list[int] = []  # ZeRO-3: the bytes left gathered after each validation of the fit

    def _counts(self) -> dict[str, int]:
        # A gradient bucket is all-reduced (one call), or reduced to its owners (one "reduce" per non-empty piece).
        return {tag: comm.LEDGER.calls("all_reduce", tag) + comm.LEDGER.calls("reduce", tag) for tag in self.TAGS} | {
            "tp bytes": comm.LEDGER.bytes("all_reduce", "tp"),
            "params": comm.LEDGER.calls("all_gather", "params"),
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start = self._counts()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(trainer.callback_metrics["train/loss"].item())
        self.ledger.append({tag: n - self._start[tag] for tag, n in self._counts().items()})
        engine = trainer.strategy.engine
        stage12 = isinstance(engine, ShardedOptimizer)
        pool = engine.reducer.buffers if stage12 and engine.reducer.transient else []
        pool_bytes = sum(t.untyped_storage().nbytes() for t in pool)
        self.memory = trainer.strategy.model_state_bytes().as_dict() | {"pool": pool_bytes}

    def on_validation_end(self, trainer, pl_module) -> None:
        engine = trainer.strategy.engine
        if isinstance(engine, ShardedParams) and trainer.state.fn == "fit":  # ZeRO-3's gathered (unsharded) bytes
            self.validated.append(sum(s.full.untyped_storage().nbytes() for s in engine.segments))


def _fit(devices: int, strategy: dict | str, accumulate: int, clip: float | None, module_cls=CharGPTModule) -> dict:
    """Fit under ``strategy`` (a registered name, or the strategy's arguments) and validate after."""
    L.seed_everything(SEED, verbose=False)
    replicas = devices // (strategy.get("tensor_parallel_size") or devices) if isinstance(strategy, dict) else 1
    strategy = lightning_zero.TensorParallelStrategy(**strategy) if isinstance(strategy, dict) else strategy
    module, recorder, norms = make_module(module_cls), Recorder(), []
    if isinstance(strategy, lightning_zero.TensorParallelStrategy):  # the global norm of each clipping
        clip_by = strategy._clip_grad_by_global_norm
        strategy._clip_grad_by_global_norm = lambda optimizer, value: norms.append(clip_by(optimizer, value).item())
    with torch.no_grad():  # every rank but 0 starts from other weights: the strategy starts from rank 0's
        for p in module.net.parameters():
            p.add_(int(os.environ["RANK"]))
    trainer = quiet_trainer(
        strategy,
        devices=devices,
        max_epochs=EPOCHS,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        callbacks=[recorder],
    )
    loader = DataLoader(make_dataset(replicas), batch_size=BATCH)
    trainer.fit(module, loader, val_dataloaders=loader)  # validation between epochs: ZeRO-3 frees what it gathered
    return {
        "weights": {k: v.detach().clone() for k, v in module.net.state_dict().items()},
        "losses": recorder.losses,
        "ledger": recorder.ledger,
        "memory": recorder.memory,
        "after_validation": recorder.validated,
        "norms": norms,
        "sampler": trainer.strategy.distributed_sampler_kwargs,
        "n_head": [block.n_head for block in module.net.blocks],
        "plain": all(type(m) in (nn.Linear, nn.Embedding) for m in (module.net.wte, module.net.head)),
        "group_left": hasattr(module, "tensor_parallel_group"),
        "validated": trainer.validate(module, DataLoader(make_dataset(replicas), batch_size=BATCH), verbose=False),
    }


def _expected_validation(replicas: int, weights: dict[str, torch.Tensor]) -> tuple[float, float]:
    net = make_net()
    net.load_state_dict(weights)
    x, y = make_dataset(replicas).tensors
    with torch.no_grad():
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
    return loss.item(), loss.exp().item()


def _check_fit(results: list[dict], replicas: int, accumulate: int, clip: float | None) -> float:
    expected = reference(replicas, accumulate, clip)
    worst = 0.0
    for rank, result in enumerate(results):
        diff = max_abs_diff(result["weights"], expected["weights"])
        worst = max(worst, diff)
        assert diff < TOLERANCE, (rank, diff)
        tp = len(results) // replicas
        assert result["losses"] == pytest.approx(expected["losses"][rank // tp], abs=TOLERANCE)
        assert result["sampler"] == {"num_replicas": replicas, "rank": rank // tp}
        assert result["n_head"] == [HEADS] * LAYERS and result["plain"] and not result["group_left"]  # whole again
    return worst


# ---------------------------------------------------------------- training parity
def test_two_tensor_parallel_ranks_match_single_process_loss_weights_and_validation():
    strategy = {"tensor_parallel_size": 2, "plan": dict(GPT_PLAN), "plan_root": "net"}
    results = run_workers(_fit, 2, 2, strategy, 1, CLIP, timeout=120)
    _check_fit(results, replicas=1, accumulate=1, clip=CLIP)
    expected_loss, expected_ppl = _expected_validation(1, results[0]["weights"])
    for result in results:  # validate() parallelizes the whole module again, and vocab-shards val/loss and val/ppl
        (metrics,) = result["validated"]
        assert metrics["val/loss"] == pytest.approx(expected_loss, abs=1e-5)
        assert metrics["val/ppl"] == pytest.approx(expected_ppl, rel=1e-5)


ZERO_STAGES = (0, 1, 2, 3)


def _fit_zero_stages() -> dict[int, dict]:
    """The 2 replicas x 2 tensor-parallel ranks fit (accumulate 2, clipping) under each ``zero_stage``, in one worker
    lifetime."""
    strategy = {"tensor_parallel_size": 2, "plan": "lightning_zero.tensor_parallel.GPT_PLAN", "plan_root": "net"}
    return {stage: _fit(4, {**strategy, "zero_stage": stage}, 2, CLIP) for stage in ZERO_STAGES}


@pytest.fixture(scope="module")
def zero_stage_fits() -> dict[int, list[dict]]:
    """Each ``zero_stage``'s results, by rank."""
    per_rank = run_workers(_fit_zero_stages, 4, timeout=240)
    return {stage: [result[stage] for result in per_rank] for stage in ZERO_STAGES}


def _window(grads: list[int], params: int, data_norm: int) -> list[dict[str, int]]:
    """The ledger of one accumulation window of 2 micro-batches: the data-parallel gradient all-reduces of each,
    then at the boundary ``params`` all-gathers, the norm's data-parallel all-reduces and one tensor-parallel one."""
    tp = {"tp": TP_PER_MICRO_BATCH, "tp bytes": TP_BYTES_PER_MICRO_BATCH}
    last = {"params": params, "grad_norm": data_norm, "tp/grad_norm": 1}
    return [
        {"grads": grads[0], "params": 0, "grad_norm": 0, "tp/grad_norm": 0, **tp},
        {"grads": grads[1], **last, **tp},
    ]


def test_two_replicas_of_two_tensor_parallel_ranks_match_and_communicate_as_theory(zero_stage_fits):
    results = zero_stage_fits[0]
    _check_fit(results, replicas=2, accumulate=2, clip=CLIP)
    window = _window([0, 1], params=0, data_norm=0)  # non-boundary: nothing; boundary: one bucket, one norm
    for result in results:
        assert result["ledger"] == window * (BATCHES // 2) * EPOCHS


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_match_the_reference_and_zero_stage_0(zero_stage_fits, stage):
    worst = _check_fit(zero_stage_fits[stage], replicas=2, accumulate=2, clip=CLIP)
    assert worst < TOLERANCE
    for plain, sharded in zip(zero_stage_fits[0], zero_stage_fits[stage]):
        assert max_abs_diff(sharded["weights"], plain["weights"]) < 1e-6


def test_zero_stages_clip_by_the_one_process_global_norm(zero_stage_fits):
    expected = reference(2, 2, CLIP)["norms"]
    assert max(expected) > CLIP  # the clipping scales the gradients
    for stage in ZERO_STAGES:
        for result in zero_stage_fits[stage]:
            assert result["norms"] == pytest.approx(expected, rel=1e-5)


def test_zero_stages_communicate_only_at_the_boundary_or_every_micro_batch(zero_stage_fits):
    """Stage 1 (``grad_sync="boundary"``) reduces nothing over the data-parallel group on non-boundary micro-batches;
    stage 2 (``"microbatch"``) reduces each. One bucket per param group (25 MiB cap), one all-gather per group. Stage
    1 all-reduces each bucket into its full gradient; stage 2 (``grad_reduction="auto"``) reduces it to its owners:
    one piece per data-parallel rank, each holding part of every group's flat."""
    pieces = 2 * PARAM_GROUPS  # 2 data-parallel replicas
    expected = {
        1: _window([0, PARAM_GROUPS], params=PARAM_GROUPS, data_norm=1),
        2: _window([pieces, pieces], params=PARAM_GROUPS, data_norm=1),
    }
    for stage, window in expected.items():
        for result in zero_stage_fits[stage]:
            assert result["ledger"] == window * (BATCHES // 2) * EPOCHS


def test_zero_stages_halve_the_optimizer_state_and_stage_2_the_gradients(zero_stage_fits):
    """Per rank, after the last step: the optimizer state of the tensor-parallel slice is split over the 2 replicas
    (both stages), the gradient storage too under stage 2 (its two-bucket pool apart, a constant); parameters stay.
    The tolerance covers the flat groups' padding and AdamW's per-parameter ``step`` scalars under zero_stage=0."""

    def gradients(memory: dict[str, int]) -> int:
        return memory["grads"] + memory["strategy_buffers"] - memory["pool"]

    for rank, plain in enumerate(zero_stage_fits[0]):
        for stage, grad_ratio in ((1, 1.0), (2, 0.5)):
            memory, base = zero_stage_fits[stage][rank]["memory"], plain["memory"]
            assert memory["optimizer"] / base["optimizer"] == pytest.approx(0.5, abs=0.01), (stage, rank)
            assert gradients(memory) / gradients(base) == pytest.approx(grad_ratio, abs=0.01), (stage, rank)
            assert memory["params"] / base["params"] == pytest.approx(1.0, abs=0.01), (stage, rank)


def test_zero_stage_3_shards_the_slices_and_keeps_the_tensor_parallel_traffic(zero_stage_fits):
    """ZeRO-3 over the data-parallel group: parameters, gradients and optimizer state of each rank's slice are split
    over the 2 replicas; the tensor-parallel group carries exactly what it carries under zero_stage=0 (the activations,
    the loss and one norm per window), and the slices are gathered ("params") and reduce-scattered over the data
    group only."""
    for rank, plain in enumerate(zero_stage_fits[0]):
        memory, base = zero_stage_fits[3][rank]["memory"], plain["memory"]
        for key in ("params", "grads", "optimizer"):
            assert memory[key] / base[key] == pytest.approx(0.5, abs=0.01), (key, rank)
        assert zero_stage_fits[3][rank]["after_validation"] == [0] * EPOCHS  # nothing left gathered
        tp_traffic = ("tp", "tp bytes", "tp/grad_norm")
        for sharded, whole in zip(zero_stage_fits[3][rank]["ledger"], plain["ledger"]):
            assert {k: sharded[k] for k in tp_traffic} == {k: whole[k] for k in tp_traffic}
            assert sharded["params"] > 0 and sharded["grad_norm"] == whole["tp/grad_norm"]


class PlainLossModule(CharGPTModule):
    """An unchanged module (``F.cross_entropy`` on whole logits) with its own plan: the head gathers its output."""

    def tensor_parallel_plan(self) -> dict:
        plan = {f"net.{key}": style for key, style in GPT_PLAN.items()}
        return {**plan, "net.head": ColwiseParallel(gather_output=True)}

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        assert logits.shape[-1] == VOCAB  # whole: gathered by the head
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train/loss", loss)
        return loss


def test_registered_name_with_the_module_plan_and_a_gathered_head():
    results = run_workers(_fit, 2, 2, "tensor_parallel_scratch", 2, None, PlainLossModule, timeout=120)
    _check_fit(results, replicas=1, accumulate=2, clip=None)


class TensorParallelBoringModel(BoringModel):
    """Lightning's ``BoringModel`` with a plan: its ``Linear(32, 2)`` split by output feature, the output gathered
    (the unchanged loss sees the whole prediction)."""

    def tensor_parallel_plan(self) -> dict:
        return {"layer": ColwiseParallel(gather_output=True)}


def _fit_boring(strategy: str | dict, devices: int) -> tuple[dict[str, torch.Tensor], list[dict]]:
    L.seed_everything(0, verbose=False)
    module = TensorParallelBoringModel()
    strategy = lightning_zero.TensorParallelStrategy(**strategy) if isinstance(strategy, dict) else strategy
    trainer = quiet_trainer(strategy, devices=devices, max_epochs=2, num_sanity_val_steps=2, limit_val_batches=2)
    trainer.fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, trainer.test(module, verbose=False)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_lightning_boring_model_trains_as_under_lightning_ddp(zero_stage):
    """2 replicas x 2 tensor-parallel ranks against Lightning's ``ddp`` on 2 ranks (the same batches per replica)."""
    ((ddp_weights, ddp_tested), _) = run_workers(_fit_boring, 2, "ddp", 2, timeout=120)
    strategy = {"tensor_parallel_size": 2, "zero_stage": zero_stage}
    for weights, tested in run_workers(_fit_boring, 4, strategy, 4, timeout=120):
        assert max_abs_diff(weights, ddp_weights) < 1e-6
        assert tested == ddp_tested


# ---------------------------------------------------------------- checkpoints
def _save_and_resume(directory: str, replicas: int, zero_stage: int) -> dict:
    """Fit 1 epoch and save, resume for a second, and fit 2 epochs straight, on ``replicas`` x 2 ranks."""

    def run(epochs: int, ckpt_path: str | None) -> dict[str, torch.Tensor]:
        L.seed_everything(SEED, verbose=False)
        module = make_module()
        strategy = lightning_zero.TensorParallelStrategy(2, GPT_PLAN, plan_root="net", zero_stage=zero_stage)
        trainer = quiet_trainer(strategy, devices=2 * replicas, max_epochs=epochs, gradient_clip_val=CLIP)
        trainer.fit(module, DataLoader(make_dataset(replicas), batch_size=BATCH), ckpt_path=ckpt_path)
        if epochs == 1:
            trainer.save_checkpoint(f"{directory}/epoch1.ckpt")
        return {k: v.detach().clone() for k, v in module.net.state_dict().items()}

    run(1, None)
    return {"resumed": run(2, f"{directory}/epoch1.ckpt"), "straight": run(2, None)}


@pytest.mark.parametrize(
    "replicas, zero_stage",
    [(1, 0), pytest.param(2, 2, id="zero_stage=2"), pytest.param(2, 3, id="zero_stage=3")],
)
def test_checkpoint_is_the_whole_unparallelized_model_and_resumes_bit_identically(tmp_path, replicas, zero_stage):
    """Under ZeRO the file holds the unsharded optimizer state too: the one-process AdamW's after the same epoch."""
    for result in run_workers(_save_and_resume, 2 * replicas, str(tmp_path), replicas, zero_stage, timeout=180):
        assert max_abs_diff(result["resumed"], result["straight"]) == 0.0
    checkpoint = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    layout = {"tensor_parallel_size": 2, "replicas": replicas, "zero_stage": zero_stage}
    assert checkpoint["parallel_layout"] == {"strategy": "tensor_parallel_scratch", **layout}
    plain = make_net()
    shapes = {f"net.{k}": v.shape for k, v in plain.state_dict().items()}
    assert {k: v.shape for k, v in checkpoint["state_dict"].items()} == shapes
    plain.load_state_dict({k.removeprefix("net."): v for k, v in checkpoint["state_dict"].items()})
    expected = reference(replicas, 1, CLIP, epochs=1)  # the file holds the trained weights, not a slice
    assert max_abs_diff(plain.state_dict(), expected["weights"]) < TOLERANCE
    decay = [p for p in plain.parameters() if p.ndim >= 2]
    optimizer = _adamw([{"params": decay}, {"params": [p for p in plain.parameters() if p.ndim < 2]}])
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])  # the plain model's optimizer takes it
    for p in plain.parameters():
        assert optimizer.state[p]["exp_avg"].shape == optimizer.state[p]["exp_avg_sq"].shape == p.shape
    saved, one_process = checkpoint["optimizer_states"][0]["state"], expected["optimizer"]["state"]
    assert saved.keys() == one_process.keys()
    for index, state in saved.items():
        assert int(state["step"]) == int(one_process[index]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert (state[key] - one_process[index][key]).abs().max() < TOLERANCE, (index, key)


def _sharded_save_and_resume(directory: str, zero_stage: int) -> dict:
    """On 2 replicas x 2 tensor-parallel ranks under ``zero_stage``: fit 1 epoch (``ModelCheckpoint`` saving a sharded
    directory at its end, the module still parallelized), then save a sharded directory and a full file of the whole
    module after the fit (counting the tensor-parallel state gathers of each); resume the in-fit directory for a
    second epoch, fit 2 epochs straight; then resume the after-fit directory and the file at other layouts
    (tensor-parallel size 4; ZeRO-3 or zero_stage 0 at 2 x 2)."""
    gathers = {}

    def run(epochs: int, ckpt_path: str | None, tp: int = 2, stage: int = zero_stage) -> dict[str, torch.Tensor]:
        L.seed_everything(SEED, verbose=False)
        module = make_module()
        strategy = lightning_zero.TensorParallelStrategy(
            tp, GPT_PLAN, plan_root="net", zero_stage=stage, state_dict_type="sharded"
        )
        saving = ckpt_path is None and epochs == 1
        callbacks = [ModelCheckpoint(dirpath=directory, filename="in_fit")] if saving else []
        trainer = quiet_trainer(
            strategy,
            devices=4,
            max_epochs=epochs,
            gradient_clip_val=CLIP,
            enable_checkpointing=saving,
            callbacks=callbacks,
        )
        trainer.fit(module, DataLoader(make_dataset(4 // tp), batch_size=BATCH), ckpt_path=ckpt_path)
        if saving:
            for kind, path in (("sharded", f"{directory}/epoch1"), ("full", f"{directory}/epoch1.ckpt")):
                strategy.state_dict_type, before = kind, comm.LEDGER.calls("all_gather", "tp_state")
                trainer.save_checkpoint(path)
                gathers[kind] = comm.LEDGER.calls("all_gather", "tp_state") - before
        return {k: v.detach().clone() for k, v in module.net.state_dict().items()}

    run(1, None)
    other_stage = 3 if zero_stage == 0 else 0
    return {
        "resumed": run(2, f"{directory}/in_fit.ckpt"),
        "straight": run(2, None),
        "tp4": (run(2, f"{directory}/epoch1", tp=4, stage=0), run(2, f"{directory}/epoch1.ckpt", tp=4, stage=0)),
        "stage": (
            run(2, f"{directory}/epoch1", stage=other_stage),
            run(2, f"{directory}/epoch1.ckpt", stage=other_stage),
        ),
        "gathers": gathers,
    }


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_sharded_checkpoint_resumes_bit_identically_and_at_other_layouts(tmp_path, zero_stage):
    """The directory holds every slice once, as the whole entry ([Note: tensor-parallel DTensors]); saving it gathers
    nothing over the tensor-parallel group; a resume is bit-identical; at tensor-parallel size 4 or another ZeRO stage
    it resumes as the full file of the same step does."""
    results = run_workers(_sharded_save_and_resume, 4, str(tmp_path), zero_stage, timeout=240)
    for rank, result in enumerate(results):
        assert max_abs_diff(result["resumed"], result["straight"]) == 0.0
        for key in ("tp4", "stage"):
            from_directory, from_file = result[key]
            assert max_abs_diff(from_directory, from_file) == 0.0, key
        assert result["gathers"]["sharded"] == 0
        assert result["gathers"]["full"] > 0 or (zero_stage and rank >= 2)  # ZeRO: replica 0 holds the whole state
    meta = read_meta(tmp_path / "epoch1")
    assert meta["parallel_layout"] == {
        "strategy": "tensor_parallel_scratch",
        "tensor_parallel_size": 2,
        "replicas": 2,
        "zero_stage": zero_stage,
    }
    saved = read_metadata(tmp_path / "epoch1").state_dict_metadata
    full = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)
    for key, value in full["state_dict"].items():  # the whole entries; the fused q/k/v as 3 blocks
        shape = (3, value.shape[0] // 3, *value.shape[1:]) if ".qkv." in key else tuple(value.shape)
        assert tuple(saved[f"model.{key}"].size) == shape, key
    name = "net.blocks.0.mlp.0.weight"
    assert tuple(saved[f"optimizer_0.state.{name}.exp_avg"].size) == tuple(full["state_dict"][name].shape)


# ---------------------------------------------------------------- refusals
def test_settings_it_cannot_run_are_refused():
    strategy = lightning_zero.TensorParallelStrategy(plan=GPT_PLAN)
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda", scaler=Mock())  # on CPU the Trainer would not
    with pytest.raises(ValueError, match="does not run precision='16-mixed'"):
        strategy._check_before_launch()
    with pytest.raises(ValueError, match="tensor_parallel_size=3 is invalid: expected a divisor of the world size 2"):
        quiet_trainer(lightning_zero.TensorParallelStrategy(tensor_parallel_size=3, plan=GPT_PLAN), devices=2)
    with pytest.raises(ValueError, match=r"does not take \['find_unused_parameters', 'param_dtype'\]"):
        lightning_zero.TensorParallelStrategy(plan=GPT_PLAN, param_dtype="bf16", find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"plan='lightning_zero\.NO_PLAN' is invalid: expected a mapping"):
        lightning_zero.TensorParallelStrategy(plan="lightning_zero.NO_PLAN")
    with pytest.raises(ValueError, match="tensor_parallel_size=0 is invalid: expected an integer >= 1"):
        lightning_zero.TensorParallelStrategy(tensor_parallel_size=0)
    for zero_stage in (4, -1, True, "2"):
        with pytest.raises(ValueError, match=rf"zero_stage={zero_stage!r} is invalid: expected 0, 1, 2 or 3"):
            lightning_zero.TensorParallelStrategy(plan=GPT_PLAN, zero_stage=zero_stage)


class NoPlanModule(CharGPTModule):
    tensor_parallel_plan = None


def _fit_without_plan() -> str:
    trainer = quiet_trainer("tensor_parallel_scratch", devices=2, max_epochs=1)
    try:
        trainer.fit(make_module(NoPlanModule), DataLoader(make_dataset(1), batch_size=BATCH))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_run_without_a_plan_is_refused_naming_the_settings():
    for message in run_workers(_fit_without_plan, 2, timeout=120):
        assert message.startswith("tensor_parallel_scratch needs a plan: pass TensorParallelStrategy(plan=")
        assert "give NoPlanModule a `tensor_parallel_plan`" in message


def test_registered_names():
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["tensor_parallel_scratch"]["strategy"] is lightning_zero.TensorParallelStrategy
    assert StrategyRegistry["tensor_parallel_scratch_spawn"]["init_params"] == {"start_method": "spawn"}
