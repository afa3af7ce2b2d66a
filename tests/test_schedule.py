import math

import pytest

from project.optim import warmup_cosine


def test_warmup_rises_linearly_to_peak():
    assert [warmup_cosine(s, 4, 100) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_falls_to_min_ratio_at_the_end():
    assert warmup_cosine(4, 4, 104) == pytest.approx(1.0)
    assert warmup_cosine(54, 4, 104) == pytest.approx(0.5)
    assert warmup_cosine(104, 4, 104, min_lr_ratio=0.1) == pytest.approx(0.1)
    assert warmup_cosine(10_000, 4, 104) == pytest.approx(0.0)  # clamps past the end


def test_no_warmup_starts_at_peak():
    assert warmup_cosine(0, 0, 10) == 1.0
    values = [warmup_cosine(s, 0, 10) for s in range(11)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_warmup_cosine_scheduler_waits_for_its_length_then_follows_the_factor():
    """WarmupCosine: factor 0 until start() gives the run's length, then warmup_cosine on each group's peak."""
    from functools import partial

    import torch

    from project.optim import WarmupCosine

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD([{"params": params[:1]}, {"params": params[1:], "lr": 0.5}], lr=0.1)
    scheduler = partial(WarmupCosine, warmup_epochs=0.5, min_lr_ratio=0.1)(optimizer)
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # length unknown: no step trains yet
    scheduler.start(total_steps=40, epochs=4)  # 10 steps an epoch: warmup = round(0.5 * 10) = 5 steps
    assert scheduler.warmup_steps == 5
    assert scheduler.get_last_lr() == [0.1 * 0.2, 0.5 * 0.2]  # step 0 of 5 trains at 1/5 of the peak
    lrs = []
    for _ in range(40):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr())
    factors = [warmup_cosine(s, 5, 40, 0.1) for s in range(1, 41)]
    assert lrs == [[0.1 * f, 0.5 * f] for f in factors]  # the same products: exact
    assert lrs[-1] == pytest.approx([0.1 * 0.1, 0.5 * 0.1])  # the cosine ends at min_lr_ratio x peak
    # A restored scheduler (resume) re-applies the current step's lr once start() gives the length again.
    restored = WarmupCosine(optimizer, warmup_epochs=0.5, min_lr_ratio=0.1)
    restored.load_state_dict(scheduler.state_dict())
    for group in optimizer.param_groups:
        group["lr"] = 123.0  # whatever the optimizer's restored state says
    restored.start(total_steps=40, epochs=4)
    assert [g["lr"] for g in optimizer.param_groups] == lrs[-1]
