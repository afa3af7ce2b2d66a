"""The run's random streams: its seed, the seeds derived from it, and every generator's state for checkpoints."""

import os
import random

import numpy as np
import torch


def run_seed() -> int:
    """`seed_everything`'s seed (Lightning keeps it only in PL_GLOBAL_SEED), else torch's initial seed."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else torch.initial_seed()


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, e.g. (run seed, epoch, batch, rank), and nothing else: a resumed process or
    another rank recomputes the stream."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def capture_rng_states() -> dict:
    """python, numpy, torch and CUDA generator states (Lightning's checkpoints hold none), in types that
    `torch.load(weights_only=True)` accepts."""
    name, keys, *rest = np.random.get_state()
    numpy = [name, torch.from_numpy(keys.astype(np.int64)), *rest]
    states = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Inverse of capture_rng_states; CUDA states only when the device count matches."""
    random.setstate(states["python"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
