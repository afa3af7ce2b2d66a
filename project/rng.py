"""The run's random streams: its seed, the seeds derived from it, and every generator's state for checkpoints.

- `run_seed()`: the one reader of the run's seed (data order, augmentation, summary.json).
- `mix_seed(...)`: a seed for (run seed, epoch, batch, ...), a function of those integers only.
- `capture_rng_states` / `restore_rng_states`: every random stream of the process, in a form
  `torch.load(weights_only=True)` accepts. Lightning's checkpoints hold weights, optimizer, schedulers, loops and
  callbacks, but no RNG state: without these, a resumed run draws different augmentations and dropout masks than
  the run it continues.
"""

import os
import random

import numpy as np
import torch


def run_seed() -> int:
    """The run's seed: `seed_everything`'s value, else the seed torch's global generator started from.

    Lightning's `seed_everything` (the CLI calls it with `seed_everything:` from the config) keeps the seed only in
    the environment variable PL_GLOBAL_SEED, where DDP processes inherit it and Lightning's own worker seeding and
    distributed-sampler injection read it too; this is the one place here that reads it. Without it (the config's
    `seed_everything: false`, or a data module used outside the CLI) the fallback is `torch.initial_seed()`: the
    value of the last `torch.manual_seed`, or torch's fixed default, so it is still the same on every rank.
    """
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else torch.initial_seed()


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers, e.g. (run seed, epoch) or (run seed, epoch, batch, rank).

    One independent stream per tuple, a function of the integers only (no global RNG, no process state), so a
    resumed process or another rank recomputes the same stream.
    """
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & 0x7FFFFFFFFFFFFFFF


def capture_rng_states() -> dict:
    """python, numpy, torch CPU and every CUDA device's generator states (only plain types and tensors)."""
    version, state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states = {
        "python": {"version": version, "state": list(state), "gauss": gauss},
        # numpy's state holds an ndarray, which weights_only loading rejects: keys travel as a tensor.
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    """Inverse of capture_rng_states. CUDA states are restored only when the device count matches."""
    py = states["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = states["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
