"""Learning-rate schedule: linear warmup, then cosine decay, as a multiplier of the peak lr."""

import math


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Factor applied to the peak learning rate at optimizer step `step` (0-based).

    Warmup rises linearly to 1.0 over `warmup_steps` (step 0 already trains, at 1/warmup_steps),
    then a half cosine falls to `min_lr_ratio` at `total_steps`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
