import math

import pytest

from project.schedule import warmup_cosine


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
