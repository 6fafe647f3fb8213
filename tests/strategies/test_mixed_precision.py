"""Mixed precision on every strategy of ours ([Note: precision policy] in ``lightning_zero/training/precision.py``).

One pair of gloo worker processes runs every fit; the tests compare them with

- a **single-process reference** in plain PyTorch that applies the same precision rules: fp32 master weights updated
  by the optimizer, the values forward sees rounded to ``param_dtype`` (and, under ``-true``, held in it), each rank's
  gradient computed on its own batch and accumulated in fp32, the ranks' gradients averaged in ``reduce_dtype``.
  It replays what the strategies do operation for operation, so the tolerance is float summation order (the global
  gradient norm of clipping is summed per shard): :data:`TOLERANCE`.
- **Lightning's** ``ddp`` at the same ``precision``: loss curves within :data:`LOSS_TOLERANCE` (a bf16 rounding of
  the parameters where Lightning's autocast leaves non-matmul weights in fp32, and no master weights under
  ``-true``, where Lightning's optimizer updates bf16 parameters).

``16-mixed`` runs with a ``GradScaler`` passed in a plugin (on CPU Lightning turns ``16-mixed`` into ``bf16-mixed``).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_zero.comm import collectives as comm
from lightning_zero.training.memory import zero_model_state_bytes
from lightning_zero.training.precision import ShardedGradScaler
from lightning_zero.zero.stage3.engine import ShardedParams
from lightning_zero.zero.stage12 import ShardedOptimizer
from tests.helpers.equivalence import make_strategy, max_diff
from tests.helpers.parity import quiet_trainer
from tests.helpers.workers import run_workers

TOLERANCE = 2e-6
LOSS_TOLERANCE = 2e-2
BF16_REDUCE_TOLERANCE = 1e-4  # fp32 training with gradients averaged in bf16: see its test
WORLD, BATCH, STEPS, SEED = 2, 4, 6, 7
EPOCH = STEPS // 2  # batches per rank and epoch: the resume tests checkpoint at the end of the first epoch
CLIP = 0.5
INIT_SCALE = 2.0**10
STRATEGIES = ("ddp_scratch", "zero1_scratch", "zero2_scratch", "zero3_scratch")
# How each strategy records its gradient reduction in the ledger: ZeRO-2 (grad_reduction="auto") reduces each bucket
# piece into its owner, ZeRO-3 reduce-scatters, the others all-reduce.
REDUCE_OPS = {"zero2_scratch": "reduce", "zero3_scratch": "reduce_scatter"}
PRECISIONS = ("bf16-mixed", "16-mixed", "bf16-true", "16-true")
LOW = {"bf16": torch.bfloat16, "16": torch.float16}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(WORLD * BATCH * EPOCH, 6, generator=g)
    return TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(len(x), 1, generator=g))


def _net() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(6, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


class MPModule(L.LightningModule):
    """A regression MLP with LayerNorm; ``inject`` = ``(step, rank)`` puts an inf into that rank's gradient shard."""

    def __init__(self, inject: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.net = _net()
        self.inject = inject
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).float(), y.float())
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.inject is not None and self.inject == (self.global_step, self.global_rank):
            _first_grad(self.trainer.strategy, self)[0] = float("inf")

    def configure_optimizers(self):
        return _optimizer(self.parameters())


def _first_grad(strategy, module) -> torch.Tensor:
    """Where this rank holds the first piece of the averaged gradient: ZeRO's shard, else a parameter's."""
    engine = getattr(strategy, "engine", None)
    if isinstance(engine, (ShardedOptimizer, ShardedParams)):
        return next(s.grad for s in engine.shard_params if s.grad is not None and s.grad.numel())
    p = next(iter(module.parameters()))
    reducer = getattr(strategy, "reducer", None)
    grad = reducer.grad_of(p) if reducer is not None else p.grad
    return grad.view(-1)


class MasterRecorder(L.Callback):
    """The communication of the training steps alone (setup and teardown gather too), and at the end of training
    (before teardown) the fp32 values the optimizer updates, by parameter name."""

    def on_train_start(self, trainer, pl_module):
        comm.LEDGER.reset()

    def on_train_end(self, trainer, pl_module):
        self.ledger = comm.LEDGER.summary()
        strategy = trainer.strategy
        self.memory = strategy.model_state_bytes() if hasattr(strategy, "model_state_bytes") else None
        reducer = getattr(getattr(strategy, "engine", None), "reducer", None)
        self.pool = sum(b.nbytes for b in reducer.buffers) if reducer is not None and reducer.transient else 0
        self.masters = _masters(strategy, pl_module)


def _masters(strategy, module) -> dict[str, torch.Tensor]:
    """ZeRO: every rank's master shards gathered (collective); ``ddp_scratch``: its master copies; else the
    parameters."""
    out: dict[str, torch.Tensor] = {}
    engine = getattr(strategy, "engine", None)
    if isinstance(engine, ShardedParams):
        for s in engine.segments:
            out.update(zip(s.names, s.gather_values(s.shard, None)))
    elif isinstance(engine, ShardedOptimizer):
        for g in engine.groups:
            full = torch.empty(g.layout.padded_numel, dtype=g.shard.dtype, device=g.shard.device)
            comm.all_gather(full, g.shard.detach())
            out.update({n: full.narrow(0, o, p.numel()) for n, p, o in zip(g.names, g.params, g.layout.offsets)})
    else:
        names = {id(p): n for n, p in module.named_parameters()}
        pairs = getattr(getattr(strategy, "_engine", None), "master_pairs", [])
        out = {names[id(p)]: m for p, m in pairs} or dict(module.named_parameters())
    return {
        k.removeprefix("net."): v.detach().float().clone().view(module.get_parameter(k).shape) for k, v in out.items()
    }


# ---------------------------------------------------------------- the runs
def _trainer_kwargs(precision: str) -> dict:
    if precision == "16-mixed":  # Lightning builds no scaler on CPU, and picks bf16 without a plugin
        return {
            "plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))]
        }
    return {"precision": precision}


def _fit(
    name: str,
    precision: str,
    inject=None,
    steps: int = STEPS,
    resume=None,
    save=None,
    trainer_kwargs: dict | None = None,
    **strategy_kwargs,
) -> dict:
    """A fit of ``steps`` optimizer steps (resumed from the checkpoint ``resume``; saving one to ``save``);
    ``trainer_kwargs`` override the ``Trainer``'s arguments (the GPU tests: ``accelerator``, ``devices``, ...)."""
    L.seed_everything(SEED, verbose=False)
    module = MPModule(inject)
    recorder = MasterRecorder()
    kwargs = dict(max_epochs=steps // EPOCH, gradient_clip_val=CLIP, callbacks=[recorder], **_trainer_kwargs(precision))
    trainer = quiet_trainer(make_strategy(name, **strategy_kwargs), **{**kwargs, **(trainer_kwargs or {})})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(_data(), batch_size=BATCH), ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    engine = getattr(trainer.strategy, "engine", None)
    with engine.summon_full_params() if hasattr(engine, "summon_full_params") else nullcontext():
        state = {k: v.detach().float().clone() for k, v in module.net.state_dict().items()}
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "masters": recorder.masters,
        "state": state,
        "losses": module.losses,
        "scale": scaler.get_scale() if scaler is not None else None,
        "dtypes": {k: v.dtype for k, v in module.net.state_dict().items()},
        "ledger": recorder.ledger,
        "memory": recorder.memory,
        "pool": recorder.pool,
        "psi": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "warned": any("differ from Lightning's ddp" in str(w.message) for w in caught),
    }


def _plain_scaler_unscale(self, optimizer):  # the bug being fixed: each rank's own verdict
    return torch.amp.GradScaler.unscale_(self, optimizer)


def _resumed(name: str, precision: str, directory: str, **strategy_kwargs) -> dict:
    """Half the steps, a checkpoint, then a fresh module and Trainer resumed from it for the other half."""
    path = f"{directory}/{name}-{precision}-{strategy_kwargs.get('state_dict_type', 'plain')}.ckpt"
    _fit(name, precision, steps=STEPS // 2, save=path, **strategy_kwargs)
    return _fit(name, precision, resume=path, **strategy_kwargs)


def _all_runs(directory: str) -> dict:
    runs = {}
    for precision in ("bf16-mixed", "16-mixed", "bf16-true"):
        runs[("ddp_scratch", precision, "resumed")] = _resumed("ddp_scratch", precision, directory)
        for name in ("zero1_scratch", "zero2_scratch", "zero3_scratch"):
            for kind in ("sharded", "full"):
                runs[(name, precision, f"resumed_{kind}")] = _resumed(name, precision, directory, state_dict_type=kind)
    for precision in ("bf16-mixed", "16-mixed"):  # robust's default rule (mean) trains as ddp_scratch does
        runs[("robust_ddp_scratch", precision)] = _fit("robust_ddp_scratch", precision)
    runs[("robust_ddp_scratch", "16-mixed", "inject")] = _fit("robust_ddp_scratch", "16-mixed", inject=(2, 1))
    for precision in PRECISIONS:
        runs[("ddp", precision)] = _fit("ddp", precision)
        for name in STRATEGIES:
            runs[(name, precision)] = _fit(name, precision)
    for name in STRATEGIES:
        runs[(name, "bf16-mixed", "reduce_bf16")] = _fit(name, "bf16-mixed", reduce_dtype="bf16")
        runs[(name, "bf16-mixed", "cast_module")] = _fit(name, "bf16-mixed", cast_module=True)
        runs[(name, "16-mixed", "inject")] = _fit(name, "16-mixed", inject=(2, 1))
    for name in ("zero1_scratch", "zero2_scratch"):
        runs[(name, "bf16-mixed", "accum_bf16")] = _fit(name, "bf16-mixed", grad_accum_dtype="bf16")
        runs[(name, "bf16-mixed", "paper")] = _fit(name, "bf16-mixed", cast_module=True, grad_accum_dtype="bf16")
    for name in ("zero1_scratch", "zero2_scratch", "zero3_scratch"):
        runs[(name, "bf16-mixed", "param_fp32")] = _fit(name, "bf16-mixed", param_dtype=None)
        runs[(name, "32-true")] = _fit(name, "32-true")
    runs[("ddp_scratch", "32-true")] = _fit("ddp_scratch", "32-true")
    for name in STRATEGIES:  # fp32 training, gradients communicated in bf16
        runs[(name, "32-true", "reduce_bf16")] = _fit(name, "32-true", reduce_dtype="bf16")
    original = ShardedGradScaler.unscale_
    ShardedGradScaler.unscale_ = _plain_scaler_unscale
    try:
        runs[("zero2_scratch", "16-mixed", "inject_plain_scaler")] = _fit("zero2_scratch", "16-mixed", inject=(2, 1))
    finally:
        ShardedGradScaler.unscale_ = original
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_workers(_all_runs, WORLD, str(tmp_path_factory.mktemp("mixed_precision")), timeout=900)


# ---------------------------------------------------------------- the reference
@dataclass(frozen=True)
class Rules:
    """The precision rules of one run, as :func:`lightning_zero.training.precision.resolve_policy` decides them."""

    autocast: torch.dtype | None  # -mixed: Lightning's autocast dtype
    compute: torch.dtype  # the dtype the module's parameters are held in
    rounded: torch.dtype | None  # the dtype the values forward sees are rounded to (param_dtype)
    reduce: torch.dtype = torch.float32
    scaler: bool = False
    accum: torch.dtype = torch.float32  # the dtype each rank's gradient and the averaged one are stored in


def rules_of(name: str, precision: str, variant: str | None = None) -> Rules:
    if precision == "32-true":
        return Rules(None, torch.float32, None, torch.bfloat16 if variant == "reduce_bf16" else torch.float32)
    low = LOW[precision.split("-")[0]]
    if precision.endswith("-true"):
        return Rules(None, low, low)
    zero = name.startswith("zero")
    if variant == "cast_module":
        return Rules(low, low, low)
    if variant == "paper":  # cast_module=True, grad_accum_dtype=bf16
        return Rules(low, low, low, accum=low)
    if variant == "accum_bf16":
        return Rules(low, torch.float32, low, accum=low)
    rounded = low if zero and variant != "param_fp32" else None
    reduce = torch.bfloat16 if variant == "reduce_bf16" else torch.float32
    return Rules(low, torch.float32, rounded, reduce, scaler=precision == "16-mixed")


def _rank_batches(world: int = WORLD, steps: int = STEPS) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Step k's batch of each rank under Lightning's shuffling ``DistributedSampler`` (seed = the global seed,
    reshuffled each epoch)."""
    data = _data()
    per_epoch = len(data) // (world * BATCH)  # EPOCH at WORLD ranks
    out = []
    for rank in range(world):
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        batches = []
        for step in range(steps):
            sampler.set_epoch(step // per_epoch)
            k = step % per_epoch
            batches.append(data[list(sampler)[k * BATCH : (k + 1) * BATCH]])
        out.append(batches)
    return out


def reference(
    rules: Rules,
    inject_step: int | None = None,
    *,
    world: int = WORLD,
    steps: int = STEPS,
    device: str = "cpu",
    init_scale: float = INIT_SCALE,
) -> dict[str, Any]:
    """One process, the same arithmetic (see the module docstring), on one thread as each worker runs: the
    reductions inside kernels (LayerNorm's weight gradient) sum in another order on two threads, and bf16 turns
    that last-bit difference into a visible one. ``world`` ranks' batches, ``steps`` optimizer steps, on ``device``
    (the GPU tests: 1 rank, CUDA, the scale Lightning's own ``GradScaler`` starts from)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(rules, inject_step, world, steps, device, init_scale)
    finally:
        torch.set_num_threads(threads)


def _reference(rules: Rules, inject_step, world: int, steps: int, device: str, init_scale: float) -> dict[str, Any]:
    net = _net()
    # Under -true Lightning casts the module before the strategy sees it: the masters start from the cast values.
    start = rules.compute if rules.autocast is None else torch.float32
    masters = [p.detach().to(start).float().to(device, copy=True) for p in net.parameters()]
    for m in masters:
        m.requires_grad_(True)
    optimizer = _optimizer(masters)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale) if rules.scaler else None
    net.to(device, rules.compute)
    batches = _rank_batches(world, steps)
    for step in range(steps):
        with torch.no_grad():
            for p, m in zip(net.parameters(), masters):
                p.copy_(m.to(rules.rounded) if rules.rounded is not None else m)
        per_rank = []
        for rank in range(world):
            x, y = (t.to(device, rules.compute) for t in batches[rank][step])  # as the precision plugin casts inputs
            net.zero_grad(set_to_none=True)
            with torch.autocast(torch.device(device).type, dtype=rules.autocast) if rules.autocast else nullcontext():
                loss = F.mse_loss(net(x).float(), y.float())
            (scaler.scale(loss) if scaler is not None else loss).backward()
            per_rank.append([p.grad.to(rules.accum) for p in net.parameters()])
        for m, grads in zip(masters, zip(*per_rank)):
            total = grads[0].to(rules.reduce)
            for grad in grads[1:]:
                total = total + grad.to(rules.reduce)
            m.grad = (total / world).to(rules.accum).float()
        if step == inject_step:
            masters[0].grad.view(-1)[0] = float("inf")
        if scaler is not None:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    names = [name for name, _ in net.named_parameters()]
    return {"masters": dict(zip(names, (m.detach().clone() for m in masters))), "scale": scaler and scaler.get_scale()}


# ---------------------------------------------------------------- tests
def _variants(name: str) -> list[tuple]:
    keys = [(name, precision) for precision in PRECISIONS]
    keys += [(name, "bf16-mixed", v) for v in ("reduce_bf16", "cast_module", "param_fp32", "accum_bf16", "paper")]
    return keys


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGIES)
def test_matches_a_reference_with_the_same_precision_rules(runs, name):
    """Every precision and setting: the master weights equal the reference's, on every rank."""
    for key in _variants(name):
        if key not in runs[0]:
            continue  # param_dtype=None: ddp_scratch's own default under -mixed, already covered
        expected = reference(rules_of(*key))["masters"]
        for rank_runs in runs:
            difference = max_diff(rank_runs[key]["masters"], expected)
            assert difference <= TOLERANCE, (key, difference)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGIES)
def test_the_module_holds_the_master_values_after_fit_in_its_own_dtype(runs, name):
    for key in _variants(name):
        if key not in runs[0]:
            continue
        precision = key[1]
        dtype = torch.float32 if precision.endswith("mixed") else LOW[precision.split("-")[0]]
        for rank_runs in runs:
            run = rank_runs[key]
            assert set(run["dtypes"].values()) == {dtype}, (key, run["dtypes"])
            rounded = {k: v.to(dtype).float() for k, v in run["masters"].items()}
            assert max_diff(run["state"], rounded) == 0, key


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_loss_curve_close_to_lightning_ddp(runs, name, precision):
    ours, peer = runs[0][(name, precision)]["losses"], runs[0][("ddp", precision)]["losses"]
    assert len(ours) == len(peer) == STEPS
    assert max(abs(a - b) for a, b in zip(ours, peer)) <= LOSS_TOLERANCE, (ours, peer)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGIES)
def test_16_true_trains_where_lightning_ddp_without_masters_does_not(runs, name):
    """AdamW's eps=1e-8 is 0 in fp16: Lightning's ddp, which updates the fp16 parameters, divides by zero."""
    peer = torch.tensor(runs[0][("ddp", "16-true")]["losses"])
    assert not torch.isfinite(peer).all(), peer
    ours = torch.tensor(runs[0][(name, "16-true")]["losses"])
    assert torch.isfinite(ours).all(), ours


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGIES)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(runs, name):
    """An inf in rank 1's gradient shard at step 2 only: every rank skips that step and halves its scale alike,
    and the weights equal a reference that skips the same step."""
    key = (name, "16-mixed", "inject")
    expected = reference(rules_of(name, "16-mixed"), inject_step=2)
    assert {rank_runs[key]["scale"] for rank_runs in runs} == {expected["scale"]} == {INIT_SCALE / 2}
    for rank_runs in runs:
        assert max_diff(rank_runs[key]["masters"], expected["masters"]) <= TOLERANCE
    assert max_diff(runs[0][key]["masters"], runs[0][(name, "16-mixed")]["masters"]) > 1e-4  # the step was skipped


@pytest.mark.timeout(900)
def test_a_per_rank_scaler_would_let_the_ranks_diverge(runs):
    """The counterfactual: GradScaler's own unscale_ sees only this rank's shard, so rank 1 alone skips."""
    key = ("zero2_scratch", "16-mixed", "inject_plain_scaler")
    assert [rank_runs[key]["scale"] for rank_runs in runs] == [INIT_SCALE, INIT_SCALE / 2]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["zero1_scratch", "zero2_scratch", "zero3_scratch"])
def test_parameters_gathered_in_param_dtype_gradients_reduced_in_reduce_dtype(runs, name):
    """The ledger: bf16-mixed gathers half the bytes of 32-true; gradients go in fp32 unless reduce_dtype=bf16."""

    def sent(key, op, tag):
        return runs[0][key]["ledger"].get((op, tag), (0, 0))[1]

    reduce_op = REDUCE_OPS.get(name, "all_reduce")
    fp32, mixed, low = (name, "32-true"), (name, "bf16-mixed"), (name, "bf16-mixed", "reduce_bf16")
    assert sent(fp32, "all_gather", "params") > 0
    assert sent(mixed, "all_gather", "params") == sent(fp32, "all_gather", "params") // 2
    assert sent(fp32, reduce_op, "grads") > 0
    assert sent(mixed, reduce_op, "grads") == sent(fp32, reduce_op, "grads")
    assert sent(low, reduce_op, "grads") == sent(fp32, reduce_op, "grads") // 2
    if name != "zero3_scratch":  # gradients stored in bf16 are still reduced in reduce_dtype (fp32)
        assert sent((name, "bf16-mixed", "accum_bf16"), reduce_op, "grads") == sent(fp32, reduce_op, "grads")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGIES)
def test_fp32_training_with_bf16_gradient_communication(runs, name):
    """``precision="32-true", reduce_dtype="bf16"``: half the gradient bytes of fp32, the rest of the run in fp32.
    The weights equal a reference that averages the ranks' gradients in bf16 and keeps the result in fp32, and differ
    from the fp32 run's (the option is applied). Measured: ``ddp_scratch`` 0, ZeRO 6e-6 (their fp32 runs differ from
    the reference by 6e-8, clipping's norm being summed per shard, and such a last-bit difference can move a gradient
    element across a bf16 rounding boundary); 1e-2 from the fp32 run."""
    reduce_op = REDUCE_OPS.get(name, "all_reduce")
    fp32, low = (name, "32-true"), (name, "32-true", "reduce_bf16")
    fp32_bytes = runs[0][fp32]["ledger"][(reduce_op, "grads")][1]
    assert runs[0][low]["ledger"][(reduce_op, "grads")][1] == fp32_bytes // 2 > 0
    expected = reference(rules_of(*low))["masters"]
    for rank_runs in runs:
        assert max_diff(rank_runs[low]["masters"], expected) <= BF16_REDUCE_TOLERANCE
        assert max_diff(rank_runs[low]["masters"], rank_runs[fp32]["masters"]) > 10 * BF16_REDUCE_TOLERANCE


def _paper_terms(key: tuple) -> tuple[int, float, float, float]:
    """ZeRO stage and bytes per element (params, grads, optimizer K) that each configuration keeps: gradients
    accumulate in fp32 (4) unless ``grad_accum_dtype="bf16"`` (2); K = 8 (AdamW's moments) plus 4 when fp32 master
    weights are kept apart; the unsharded parameters in the module's dtype (4, or 2 when cast); under ZeRO-3 the fp32
    shard is the master (K = 8)."""
    name, precision, variant = (*key, None)[:3]
    stage = 0 if name == "ddp_scratch" else int(name[4])
    low_module = precision.endswith("-true") or variant in ("cast_module", "paper")
    masters = (stage in (1, 2) and variant != "param_fp32") or low_module
    if stage == 3:
        return 3, 4, 4, 8
    return stage, 2 if low_module else 4, 2 if variant in ("accum_bf16", "paper") else 4, 12 if masters else 8


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", STRATEGIES)
def test_model_state_bytes_follow_the_zero_accounting(runs, name):
    """Measured per rank by the memory ledger: the formula of ``lightning_zero.training.memory.zero_model_state_bytes``
    for the bytes each configuration keeps, within 1% (padding, AdamW's step counters, a ZeRO-3 placeholder), plus
    ZeRO-2's two pooled gradient buckets."""
    for key in _variants(name):
        if key not in runs[0]:
            continue
        stage, params, grads, optimizer = _paper_terms(key)
        for rank_runs in runs:
            run = rank_runs[key]
            expected = zero_model_state_bytes(
                stage, run["psi"], WORLD, param_bytes=params, grad_bytes=grads, optimizer_bytes=optimizer
            )
            measured = run["memory"].total - run["pool"]
            assert measured == pytest.approx(expected, rel=0.01), (key, run["memory"], expected)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["zero1_scratch", "zero2_scratch"])
def test_cast_module_with_bf16_gradients_is_the_papers_accounting(runs, name):
    """``cast_module=True, grad_accum_dtype="bf16"``: 2Ψ bf16 parameters, 2Ψ (stage 1) or 2Ψ/N (stage 2) bf16
    gradients and 12Ψ/N of fp32 masters and AdamW moments: 4Ψ + 12Ψ/N and 2Ψ + 14Ψ/N, the ZeRO paper's figures
    (``zero_model_state_bytes``' defaults), within 1% plus stage 2's two pooled buckets."""
    stage = int(name[4])
    for rank_runs in runs:
        run = rank_runs[(name, "bf16-mixed", "paper")]
        psi = run["psi"]
        paper = (4 * psi + 12 * psi / WORLD) if stage == 1 else (2 * psi + 14 * psi / WORLD)
        assert zero_model_state_bytes(stage, psi, WORLD) == pytest.approx(paper)
        assert run["memory"].total - run["pool"] == pytest.approx(paper, rel=0.01), run["memory"]
        assert run["pool"] <= 2 * 2 * psi  # two bf16 buckets at most


@pytest.mark.timeout(900)
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", STRATEGIES)
def test_resuming_is_bit_identical(runs, name, precision):
    """The fp32 master weights travel in the checkpoint (ZeRO: sharded and full), with the optimizer and scaler."""
    kinds = ["resumed"] if name == "ddp_scratch" else ["resumed_sharded", "resumed_full"]
    for rank_runs in runs:
        whole = rank_runs[(name, precision)]
        for kind in kinds:
            resumed = rank_runs[(name, precision, kind)]
            assert max_diff(resumed["masters"], whole["masters"]) == 0, (
                kind,
                max_diff(resumed["masters"], whole["masters"]),
            )
            assert resumed["scale"] == whole["scale"]


@pytest.mark.timeout(900)
def test_rounding_parameters_is_announced_unless_asked_for(runs):
    """The default param_dtype of ZeRO under -mixed changes the arithmetic from ddp's: one warning on rank 0."""
    for name in ("zero1_scratch", "zero2_scratch", "zero3_scratch"):
        assert runs[0][(name, "bf16-mixed")]["warned"], name
        assert not runs[1][(name, "bf16-mixed")]["warned"]  # rank_zero_warn
        for quiet in ((name, "bf16-mixed", "param_fp32"), (name, "bf16-true"), (name, "32-true")):
            assert not runs[0][quiet]["warned"], quiet
    assert not runs[0][("ddp_scratch", "bf16-mixed")]["warned"]


@pytest.mark.timeout(900)
def test_robust_mean_under_mixed_precision_and_loss_scaling(runs):
    """``robust_ddp_scratch`` (mean of the workers) differentiates each worker's loss itself: it must apply the
    scaler's loss scale too (it once did not, and AdamW then stepped on gradients 2**-10 too small), and its
    overflow verdict must be every rank's."""
    for precision in ("bf16-mixed", "16-mixed"):
        expected = reference(rules_of("ddp_scratch", precision))["masters"]
        for rank_runs in runs:
            assert max_diff(rank_runs[("robust_ddp_scratch", precision)]["masters"], expected) <= TOLERANCE, precision
    skipped = reference(rules_of("ddp_scratch", "16-mixed"), inject_step=2)
    for rank_runs in runs:
        run = rank_runs[("robust_ddp_scratch", "16-mixed", "inject")]
        assert run["scale"] == skipped["scale"] == INIT_SCALE / 2
        assert max_diff(run["masters"], skipped["masters"]) <= TOLERANCE
