"""Train/val/test splits: one pure function of the sample list, its labels and `split_seed`, for every data path.

The image module (digits, ImageFolder, torchvision files), the any-Dataset module and `prepare` (the streaming
chunks) all call `carve`, so the same data and settings give the same split membership on every path, and a
split never moves with the training seed: the permutations draw from a generator seeded by `split_seed` alone,
never from the global RNG.
"""

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from project.errors import ConfigError

# The order splits are carved in: test from the whole pool, then val from what is left.
CARVE_ORDER = ("test", "val")


def stratified_split(
    labels: Tensor | Sequence[int], fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Split indices 0..N-1 into (rest, held_out), `fraction` of them held out, class ratios preserved.

    ceil(fraction * N) indices are held out (as scikit-learn's train_test_split counts), shared among the classes
    in proportion to their sizes (largest remainders get the leftover places); within each class the members
    are drawn by a permutation seeded by `seed`, so the same seed gives the same split on every machine.
    Raises ValueError when a class has fewer than 2 members or either side would be smaller than the number
    of classes.
    """
    labels = torch.as_tensor(
        labels if isinstance(labels, Tensor) else list(map(int, labels)), dtype=torch.long
    )
    n = len(labels)
    if fraction <= 0:
        return list(range(n)), []
    classes, counts = torch.unique(labels, return_counts=True)
    n_held = math.ceil(fraction * n)
    if counts.min() < 2:
        rare = int(classes[counts.argmin()])
        raise ValueError(
            f"class {rare} has {int(counts.min())} member; stratifying needs at least 2 per class."
        )
    if min(n_held, n - n_held) < len(classes):
        raise ValueError(
            f"holding out {n_held} of {n} samples leaves a side with fewer samples than the {len(classes)} classes."
        )
    share = counts.double() * n_held / n
    held_per_class = share.floor().long()
    leftover = n_held - int(held_per_class.sum())
    order = sorted(range(len(classes)), key=lambda c: (-(share[c] - held_per_class[c]).item(), c))
    for c in order[:leftover]:
        held_per_class[c] += 1
    g = torch.Generator().manual_seed(seed)
    held: list[int] = []
    for c, k in zip(classes.tolist(), held_per_class.tolist()):
        members = torch.nonzero(labels == c).flatten()
        held += members[torch.randperm(len(members), generator=g)[:k]].tolist()
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], sorted(held)


def random_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(rest, held_out) of 0..n-1 without labels: ceil(fraction * n) held out by a permutation seeded by `seed`."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    held = sorted(order[: math.ceil(fraction * n)])
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], held


def data_flag(name: str) -> str:
    """How the training CLI spells a split's fraction."""
    return f"--data.init_args.{name}_fraction"


def carve(
    labels: Sequence[int] | Tensor | None,
    n: int,
    fractions: dict[str, float],
    seed: int,
    flag: Callable[[str], str] = data_flag,
) -> dict[str, list[int]]:
    """The splits carved from a pool of n samples: {"train": indices, <name>: indices for each name in fractions}.

    fractions: the splits to carve ("test" and/or "val"; a split given by the data, a folder or a dataset, is
        not listed) and their shares. Test is carved from the whole pool first, then val from the rest.
    labels: the pool's labels (stratified splits), or None (a seeded random split).
    flag: names the setting in errors (the training CLI's by default; prepare passes its own).
    """
    index = list(range(n))
    out: dict[str, list[int]] = {}
    for name in CARVE_ORDER:
        if name not in fractions:
            continue
        fraction = fractions[name]
        if not 0 < fraction < 1:
            raise ConfigError(
                f"There is no {name} split and {flag(name)} is {fraction}: the {name} split is carved from the "
                f"training data, so it needs a share in (0, 1). Pass {flag(name)} 0.1, or give a {name} split."
            )
        if labels is None:
            keep, held = random_split(len(index), fraction, seed)
        else:
            try:
                keep, held = stratified_split([int(labels[i]) for i in index], fraction, seed)
            except ValueError as err:
                raise ConfigError(
                    f"Cannot hold out a stratified {name} split ({flag(name)} {fraction}) from {len(index)} "
                    f"samples: {err} Change {flag(name)}, give a {name} split, or add data."
                ) from err
        index, out[name] = [index[i] for i in keep], [index[i] for i in held]
    out["train"] = index
    return out
