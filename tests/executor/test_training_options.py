"""The training semantics' optimizer pieces: the learning-rate schedule, the optimizers from
torch.optim, and the global-norm clipping (torch's rule, split over ranks)."""

from __future__ import annotations

import math

import pytest
import torch

from tessera.backends.torch_optim import global_norm_clip
from tessera.executor.training import TrainOptions, lr_factor, make_optimizer


def test_warmup_then_cosine_reaches_zero_at_the_last_step() -> None:
    options = TrainOptions(steps=10, lr_schedule="cosine", warmup_steps=2)
    factors = [lr_factor(k, options) for k in range(10)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[3] == pytest.approx(0.5 * (1 + math.cos(math.pi / 8)))
    assert all(a >= b for a, b in zip(factors[2:], factors[3:], strict=False))
    assert lr_factor(10, options) == pytest.approx(0.0, abs=1e-12)


def test_linear_and_constant_schedules() -> None:
    assert [lr_factor(k, TrainOptions(steps=4, lr_schedule="linear")) for k in range(4)] == [
        1.0,
        0.75,
        0.5,
        0.25,
    ]
    assert {lr_factor(k, TrainOptions(steps=4)) for k in range(4)} == {1.0}


@pytest.mark.parametrize(
    ("name", "cls", "decay"),
    [("sgd", torch.optim.SGD, 0.0), ("adamw", torch.optim.AdamW, 0.01), ("adam", torch.optim.Adam, 0.0)],
)
def test_each_optimizer_is_torchs_with_its_own_default_decay(name: str, cls: type, decay: float) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    opt, schedule = make_optimizer([p], TrainOptions(optimizer=name, lr=0.1, warmup_steps=2))
    assert type(opt) is cls and opt.param_groups[0]["weight_decay"] == decay
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)  # the first warm-up step
    opt.step()
    schedule.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


@pytest.mark.parametrize("name", ["sgd", "adamw", "adam"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_optimizer_updates_every_element_as_torchs_unfused_loop_does(name: str, dtype) -> None:
    """Whatever kernel tessera picks (fused where torch's is right), a step moves each weight as the
    plain per-tensor loop does; torch 2.13's fused CPU SGD left all but a half-precision tensor's
    last numel % 16 elements where they were."""
    g = torch.Generator().manual_seed(0)
    start, grad = torch.randn(8, 33, generator=g).to(dtype), torch.randn(8, 33, generator=g).to(dtype)
    ours, loop = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ours.grad, loop.grad = grad.clone(), grad.clone()
    opt, _schedule = make_optimizer([ours], TrainOptions(optimizer=name, lr=0.1))  # (the schedule wraps step)
    opt.step()
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[name]
    cls([loop], lr=0.1, foreach=False).step()
    assert float((ours.detach() != start).float().mean()) > 0.9  # (bf16 may round a small step away)
    torch.testing.assert_close(
        ours.detach(), loop.detach(), rtol=1e-2 if dtype != torch.float32 else 1e-6, atol=1e-3
    )


def test_global_norm_clip_is_torchs_clip_grad_norm() -> None:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5)]
    twins = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5)]
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    norm = global_norm_clip(params, params, 0.5)
    want = torch.nn.utils.clip_grad_norm_(twins, 0.5)
    assert norm == pytest.approx(float(want), rel=1e-6)
    for p, q in zip(params, twins, strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    before = [p.grad.clone() for p in params]
    global_norm_clip(params, params, 100.0)  # below the bound: untouched
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params, strict=True))
