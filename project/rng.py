"""Every random stream of the process, captured and restored in a form `torch.load(weights_only=True)` accepts.

Lightning's checkpoints hold weights, optimizer, schedulers, loops and callbacks, but no RNG state: without
these, a resumed run draws different augmentations and dropout masks than the run it continues.
"""

import random

import numpy as np
import torch


def epoch_seed(seed: int, epoch: int, stream: int = 0) -> int:
    """A seed for (run seed, epoch, stream) that depends on nothing else (no global RNG, no process state)."""
    return (seed * 1_000_003 + epoch * 10_007 + stream * 101) % (2**63 - 1)


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
