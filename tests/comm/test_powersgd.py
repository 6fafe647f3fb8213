"""PowerSGD (``lightning_zero/comm/powersgd.py``): the pure rules without processes, then the compressor on a
:class:`GradientReducer` against torch's own ``powerSGD_hook`` (the oracle, imported here only) on 2 gloo processes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.comm import collectives as comm
from lightning_zero.comm.powersgd import (
    PowerSGDCompressor,
    compressed_step_bytes,
    factor_order,
    orthogonalize,
    plan_tensors,
)
from lightning_zero.comm.powersgd_config import PowerSGDConfig, compression_config, refuse_on_zero
from lightning_zero.dp.buckets import GradBucket
from lightning_zero.dp.reducer import GradientReducer
from tests.helpers.workers import free_port, run_workers

# ------------------------------------------------------------------------------------------ the decision rule


@pytest.mark.parametrize(
    ("shape", "rank", "rate", "expected"),
    [
        ((16,), 1, 2.0, (16, 1, 1, False)),  # a vector: (16 + 1) * 1 * 2 = 34 >= 16
        ((16,), 1, 0.5, (16, 1, 1, True)),  # (17) * 0.5 = 8.5 < 16: torch compresses it too
        ((16, 6), 1, 2.0, (16, 6, 1, True)),  # 22 * 2 = 44 < 96
        ((16, 6), 4, 2.0, (16, 6, 4, False)),  # 22 * 4 * 2 = 176 >= 96
        ((3, 16), 8, 1.0, (3, 16, 3, False)),  # r = min(n, m, rank) = 3: 19 * 3 = 57 >= 48
        ((3, 16), 2, 1.0, (3, 16, 2, True)),  # 19 * 2 = 38 < 48
        ((8, 3, 3, 3), 2, 2.0, (8, 27, 2, True)),  # a conv kernel is 8 x 27: 35 * 2 * 2 = 140 < 216
        ((1, 100), 1, 0.0, (1, 100, 1, True)),  # rate 0 compresses every non-empty matrix
        ((), 1, 0.0, (1, 1, 0, False)),  # a scalar: never (torch cannot view it as a matrix)
        ((0, 4), 1, 0.0, (1, 0, 0, False)),  # empty: never
    ],
)
def test_plan_is_torchs_rule(shape, rank, rate, expected):
    (plan,) = plan_tensors([shape], rank, rate)
    assert (plan.n, plan.m, plan.r, plan.compress) == expected
    assert plan.sent_numel == ((plan.n + plan.m) * plan.r if plan.compress else math.prod(shape))


def test_factors_are_grouped_by_matrix_shape_in_order_of_first_appearance():
    shapes = [(5,), (5, 32), (32, 128), (128,), (128, 32), (32,), (32, 128), (8, 27)]
    plans = plan_tensors(shapes, 1, 2.0)
    assert [p.compress for p in plans] == [False, True, True, False, True, False, True, True]
    assert factor_order(plans) == [1, 2, 6, 4, 7]  # the two 32 x 128 matrices side by side


def test_compressed_step_bytes():
    config = PowerSGDConfig(rank=2)
    # (32 + 128) * 2 compressed + 32 + 5 uncompressed, fp32
    assert compressed_step_bytes([(32, 128), (32,), (5,)], config) == ((32 + 128) * 2 + 37) * 4
    assert compressed_step_bytes([(32, 128)], config, element_size=2) == (32 + 128) * 2 * 2


@pytest.mark.parametrize("r", [1, 2, 4])
def test_orthogonalize_matches_torch_bit_for_bit(r):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    g = torch.Generator().manual_seed(r)
    ours = torch.randn(1, 20, r, generator=g)
    theirs = ours.clone()
    orthogonalize(ours)
    _orthogonalize(theirs)
    assert torch.equal(ours, theirs)
    eye = ours[0].T @ ours[0]
    assert torch.allclose(eye, torch.eye(r), atol=1e-5)


def test_orthogonalize_keeps_a_zero_column_at_zero_where_torch_divides_by_zero():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    ours = torch.zeros(1, 6, 1)
    theirs = ours.clone()
    orthogonalize(ours)
    _orthogonalize(theirs)
    assert torch.equal(ours, torch.zeros(1, 6, 1))
    assert theirs.isnan().all()


# ------------------------------------------------------------------------------------------ settings


def test_defaults_are_torchs():
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    state = PowerSGDState(process_group=None)
    config = PowerSGDConfig()
    assert config.rank == state.matrix_approximation_rank
    assert config.start_iter == state.start_powerSGD_iter
    assert config.min_compression_rate == state.min_compression_rate
    assert config.warm_start == state.warm_start and config.error_feedback == state.use_error_feedback
    assert config.orthogonalization_epsilon == state.orthogonalization_epsilon


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"rank": 0}, "powersgd rank=0 is invalid: expected an integer >= 1"),
        ({"rank": 1.5}, "powersgd rank=1.5 is invalid: expected an integer >= 1"),
        ({"rank": True}, "powersgd rank=True is invalid"),
        ({"start_iter": -1}, "powersgd start_iter=-1 is invalid: expected an integer >= 0"),
        ({"min_compression_rate": -0.5}, "powersgd min_compression_rate=-0.5 is invalid: expected a number >= 0"),
        ({"min_compression_rate": float("nan")}, "powersgd min_compression_rate=nan is invalid"),
        ({"warm_start": "yes"}, "powersgd warm_start='yes' is invalid: expected True or False"),
        ({"error_feedback": 1}, "powersgd error_feedback=1 is invalid: expected True or False"),
        ({"seed": 2**32}, r"powersgd seed=4294967296 is invalid: expected an integer in \[0, 2\*\*32\)"),
        ({"orthogonalization_epsilon": -1e-8}, "powersgd orthogonalization_epsilon=-1e-08 is invalid"),
        ({"rnak": 2}, r"powersgd has unknown options \['rnak'\]: expected some of \['rank', 'start_iter'"),
    ],
)
def test_bad_options_raise_naming_the_setting(options, message):
    with pytest.raises(ValueError, match=message):
        PowerSGDConfig.from_options(options)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_compression": "zip"}, r"grad_compression='zip' is invalid: expected None or one of \('powersgd',\)"),
        ({"grad_compression": None, "powersgd": {"rank": 2}}, r"powersgd=\{'rank': 2\} is set but grad_compression"),
        ({"grad_compression": "powersgd", "powersgd": [1]}, r"powersgd=\[1\] is invalid: expected None or a dict"),
        (
            {"grad_compression": "powersgd", "reduce_dtype": torch.bfloat16},
            "reduce_dtype=torch.bfloat16 cannot be combined with grad_compression='powersgd'",
        ),
    ],
)
def test_bad_combinations_raise_one_clear_error(kwargs, message):
    kwargs = {"powersgd": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        compression_config(kwargs.pop("grad_compression"), kwargs.pop("powersgd"), **kwargs)


def test_good_combinations():
    assert compression_config(None, None) is None
    assert compression_config(None, {}) is None  # the Hydra schema's empty default
    assert compression_config("powersgd", None) == PowerSGDConfig()
    assert compression_config("powersgd", {"rank": 4}, reduce_dtype=None) == PowerSGDConfig(rank=4)


def test_zero_refuses_compression_and_lets_none_pass():
    kwargs = {"grad_compression": None, "powersgd": None, "bucket_size_mb": 1}
    refuse_on_zero("zero1_scratch", kwargs)
    assert kwargs == {"bucket_size_mb": 1}
    with pytest.raises(ValueError, match="grad_compression='powersgd' is not supported by zero1_scratch"):
        refuse_on_zero("zero1_scratch", {"grad_compression": "powersgd"})


# ------------------------------------------------------------------------------------------ one rank, in-process


@pytest.fixture
def one_rank():
    """A 1-process gloo group in this process (the conftest fixture destroys it afterwards)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


MEMBERS = [(0, (8, 8)), (64, (8,))]  # an 8 x 8 matrix (compressed at rank 1) and a vector (not)


def _gradient() -> torch.Tensor:
    return torch.randn(72, generator=torch.Generator().manual_seed(0))


def test_error_feedback_keeps_what_compression_dropped(one_rank):
    compressor = PowerSGDCompressor(PowerSGDConfig(rank=1, start_iter=0))
    gradient = _gradient()
    buffer = gradient.clone()
    compressor.all_reduce(0, buffer, MEMBERS)
    error = compressor.state_dict()["buckets"][0]["error"][0]
    assert torch.allclose(buffer + error, gradient, atol=1e-6)  # the result plus the error is the input
    assert torch.equal(buffer[64:], gradient[64:]) and (error[64:] == 0).all()  # the vector: the plain average
    assert torch.linalg.matrix_rank(buffer[:64].view(8, 8)) == 1 and error[:64].abs().max() > 0.1


def test_a_non_finite_step_keeps_the_last_error_and_starts_q_afresh(one_rank):
    compressor = PowerSGDCompressor(PowerSGDConfig(rank=1, start_iter=0))
    compressor.all_reduce(0, _gradient(), MEMBERS)
    before = compressor.state_dict()["buckets"][0]
    overflow = _gradient()
    overflow[3] = float("inf")
    compressor.all_reduce(0, overflow, MEMBERS)
    assert not overflow.isfinite().all()  # the loss scaler sees it and skips the step
    after = compressor.state_dict()["buckets"][0]
    assert torch.equal(after["error"], before["error"]) and after["q"] is None
    recovered = _gradient()
    compressor.all_reduce(0, recovered, MEMBERS)
    assert recovered.isfinite().all()


def test_a_state_of_another_world_size_or_bucket_layout_is_refused(one_rank):
    compressor = PowerSGDCompressor(PowerSGDConfig(rank=1, start_iter=0))
    compressor.all_reduce(0, _gradient(), MEMBERS)
    state = compressor.state_dict()
    with pytest.raises(ValueError, match="world_size=2, this run has world_size=1: resume with as many processes"):
        PowerSGDCompressor(PowerSGDConfig()).load_state_dict({**state, "world_size": 2})
    fresh = PowerSGDCompressor(PowerSGDConfig(rank=1, start_iter=0))
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match="error feedback of bucket 0 has 72 elements, but this bucket needs 80"):
        fresh.all_reduce(0, torch.zeros(80), [(0, (8, 10))])


# ------------------------------------------------------------------------------------------ against torch's hook
ITERATIONS = 6
ORACLE_CONFIGS = {
    # rank <= 2: Gram-Schmidt; warm start; error feedback.
    "gram_schmidt_warm": PowerSGDConfig(rank=2, start_iter=2, min_compression_rate=2.0, seed=3),
    # rank 4: torch.linalg.qr; a fresh random Q every step; an epsilon; every matrix compressed (rate 1).
    "qr_cold": PowerSGDConfig(
        rank=4, start_iter=3, min_compression_rate=1.0, warm_start=False, seed=11, orthogonalization_epsilon=1e-8
    ),
    # no error feedback
    "no_error_feedback": PowerSGDConfig(rank=1, start_iter=2, error_feedback=False, seed=5),
}
RESUME_AT = 4  # a compressor state saved after this many iterations and loaded into a fresh one
# torch divides the plain (pre-start) average before the sum, our reducer averages with ReduceOp.AVG: those steps
# agree to a rounding; the compressed steps run the same operations in the same order, so they agree bit for bit
# here. The tolerance allows for a different summation order inside a BLAS call or a collective on another machine:
# 1e-6 relative to each gradient's largest magnitude (fp32 has 2**-24 ~ 6e-8 relative resolution).
RELATIVE_TOLERANCE = 1e-6


class _Net(nn.Module):
    """A conv kernel (8 x 27), two 32 x 128 matrices apart in bucket order (they share a factor group), square and
    narrow matrices, biases: every branch of the decision rule and of the factor layout."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3)
        self.fc1, self.fc2 = nn.Linear(128, 32), nn.Linear(32, 32)
        self.fc3, self.fc4 = nn.Linear(32, 128), nn.Linear(128, 32)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.fc1(torch.tanh(self.conv(x)).flatten(1)))
        x = torch.tanh(self.fc4(torch.tanh(self.fc3(torch.tanh(self.fc2(x))))))
        return self.head(x)


def _input(rank: int, iteration: int) -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(1000 * iteration + rank))


def _grads(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in net.named_parameters()}


def _oracle(config: PowerSGDConfig) -> tuple[list[dict[str, torch.Tensor]], list[list[str]]]:
    """Torch DDP (one bucket) with ``powerSGD_hook``: the averaged gradients per iteration and the bucket's
    parameter order at each call."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    net = _Net()
    ddp = DistributedDataParallel(net, bucket_cap_mb=64)
    state = PowerSGDState(
        process_group=None,
        matrix_approximation_rank=config.rank,
        start_powerSGD_iter=config.start_iter,
        min_compression_rate=config.min_compression_rate,
        use_error_feedback=config.error_feedback,
        warm_start=config.warm_start,
        orthogonalization_epsilon=config.orthogonalization_epsilon,
        random_seed=config.seed,
    )
    names = {p.data_ptr(): n for n, p in net.named_parameters()}
    orders: list[list[str]] = []

    def hook(state, bucket):
        orders.append([names[p.data_ptr()] for p in bucket.parameters()])
        return powerSGD_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    grads = []
    for iteration in range(ITERATIONS):
        net.zero_grad(set_to_none=True)
        ddp(_input(dist.get_rank(), iteration)).square().sum().backward()
        grads.append(_grads(net))
    return grads, orders


def _ours(
    config: PowerSGDConfig, order: list[str], iterations: range, state: dict | None = None
) -> tuple[list[dict[str, torch.Tensor]], list[dict], dict]:
    """Our reducer with one bucket in ``order`` (torch's, so both draw the random Q's in the same order): the
    averaged gradients and the ledger of each iteration of ``iterations``, and the compressor's state at the end."""
    net = _Net()
    by_name = dict(net.named_parameters())
    params = [by_name[n] for n in order]
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    numel = sum(p.numel() for p in params)
    bucket = GradBucket(tuple(range(len(params))), tuple(offsets), numel, torch.float32, torch.device("cpu"))
    bucket.buffer = torch.zeros(numel)
    compressor = PowerSGDCompressor(config)
    if state is not None:
        compressor.load_state_dict(state)
    reducer = GradientReducer(params, order, [bucket], compressor=compressor)
    grads, ledgers = [], []
    for iteration in iterations:
        for p in params:
            p.grad = None
        comm.LEDGER.reset()
        net(_input(dist.get_rank(), iteration)).square().sum().backward()
        ledgers.append(comm.LEDGER.summary())
        grads.append(_grads(net))
    reducer.remove()
    return grads, ledgers, compressor.state_dict()


def _plain_averages() -> list[dict[str, torch.Tensor]]:
    """The uncompressed average of every iteration's gradients."""
    net, averages = _Net(), []
    for iteration in range(ITERATIONS):
        net.zero_grad(set_to_none=True)
        net(_input(dist.get_rank(), iteration)).square().sum().backward()
        for p in net.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        averages.append(_grads(net))
    return averages


def _oracle_worker() -> dict:
    dist.init_process_group("gloo")
    out = {"plain": _plain_averages()}
    for name, config in ORACLE_CONFIGS.items():
        oracle, orders = _oracle(config)
        order = orders[-1]  # DDP rebuilds its bucket after the first iteration, in gradient-ready order
        assert all(o == order for o in orders[2:]), orders
        ours, ledgers, _ = _ours(config, order, range(ITERATIONS))
        _, _, saved = _ours(config, order, range(RESUME_AT))
        resumed, _, _ = _ours(config, order, range(RESUME_AT, ITERATIONS), state=saved)
        shapes = [tuple(dict(_Net().named_parameters())[n].shape) for n in order]
        out[name] = {"oracle": oracle, "ours": ours, "ledgers": ledgers, "resumed": resumed, "shapes": shapes}
    return out


@pytest.fixture(scope="module")
def oracle_runs():
    return run_workers(_oracle_worker, 2, timeout=120)


def _relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_compressed_average_equals_torchs_powersgd_hook(oracle_runs, name):
    """Same configuration, same inputs, ``ITERATIONS`` steps across ``start_iter`` (error feedback and Q memories
    carried from step to step): every averaged gradient within ``RELATIVE_TOLERANCE`` of the hook's, on every rank."""
    config = ORACLE_CONFIGS[name]
    for run in oracle_runs:
        run = run[name]
        for iteration, (ours, oracle) in enumerate(zip(run["ours"], run["oracle"])):
            for key in oracle:
                difference = _relative_difference(ours[key], oracle[key])
                assert difference <= RELATIVE_TOLERANCE, (iteration, key, difference)
        # the plain average before start_iter, another one after it (a rank-r approximation of the average)
        for iteration, (ours, plain) in enumerate(zip(run["ours"], oracle_runs[0]["plain"])):
            differences = [_relative_difference(ours[k], plain[k]) for k in plain]
            if iteration < config.start_iter:
                assert max(differences) <= RELATIVE_TOLERANCE, (iteration, differences)
            else:
                assert max(differences) > 0.01, (iteration, differences)
    # both ranks hold the same average
    for a, b in zip(oracle_runs[0][name]["ours"], oracle_runs[1][name]["ours"]):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_ledger_bytes_per_step_are_the_theory(oracle_runs, name):
    """A compressed step sends ``sum over compressed (n + m) * r * 4`` bytes in P and Q plus the uncompressed
    tensors' ``numel * 4`` (the rule's arithmetic written out again here), and a plain step the whole bucket."""
    config = ORACLE_CONFIGS[name]
    run = oracle_runs[0][name]
    p_q, plain = 0, 0
    for shape in run["shapes"]:
        n = shape[0]
        m = math.prod(shape) // n
        r = min(n, m, config.rank)
        compress = (n + m) * r * config.min_compression_rate < n * m
        p_q += (n + m) * r * 4 if compress else 0
        plain += n * m * 4 if not compress else 0
    bucket_bytes = sum(math.prod(s) for s in run["shapes"]) * 4
    assert p_q > 0 and plain > 0  # both paths run in every configuration here
    for iteration, ledger in enumerate(run["ledgers"]):
        if iteration < config.start_iter:
            assert ledger == {("all_reduce", "grads"): (1, bucket_bytes)}
            continue
        assert set(ledger) == {
            ("all_reduce", "grads_powersgd_uncompressed"),
            ("all_reduce", "grads_powersgd_p"),
            ("all_reduce", "grads_powersgd_q"),
        }
        assert ledger[("all_reduce", "grads_powersgd_uncompressed")] == (1, plain)
        assert sum(b for _, b in (ledger[("all_reduce", t)] for t in ("grads_powersgd_p", "grads_powersgd_q"))) == p_q
        assert sum(b for _, b in ledger.values()) == compressed_step_bytes(run["shapes"], config)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(ORACLE_CONFIGS))
def test_state_dict_resume_is_bit_identical(oracle_runs, name):
    """``RESUME_AT`` iterations, ``state_dict()``, a fresh compressor loading it, the rest: the straight run's
    gradients bit for bit (error feedback, Q memory, the seed generator and the iteration count travel)."""
    for run in oracle_runs:
        straight = run[name]["ours"][RESUME_AT:]
        for a, b in zip(run[name]["resumed"], straight, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)
