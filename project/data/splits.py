"""Train/val/test splits for every data module and `prepare`: a function of the labels and `split_seed` only (its
own generator), so a split never moves with the training seed."""

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from project.errors import ConfigError


def stratified_split(
    labels: Tensor | Sequence[int], fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """(rest, held_out) of 0..N-1: ceil(fraction * N) held out (scikit-learn's count), shared among the classes
    in proportion to their sizes (largest remainders first), each class's drawn by a permutation seeded by `seed`."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    n = len(labels)
    if fraction <= 0:
        return list(range(n)), []
    classes, counts = torch.unique(labels, return_counts=True)
    n_held = math.ceil(fraction * n)
    if counts.min() < 2:
        raise ValueError(
            f"class {int(classes[counts.argmin()])} has {int(counts.min())} member; stratifying needs at least 2 "
            "per class."
        )
    if min(n_held, n - n_held) < len(classes):
        raise ValueError(
            f"holding out {n_held} of {n} samples leaves a side with fewer samples than the {len(classes)} classes."
        )
    share = counts.double() * n_held / n
    per_class = share.floor().long()
    order = sorted(range(len(classes)), key=lambda c: (-(share[c] - per_class[c]).item(), c))
    for c in order[: n_held - int(per_class.sum())]:
        per_class[c] += 1
    g = torch.Generator().manual_seed(seed)
    held: list[int] = []
    for c, k in zip(classes.tolist(), per_class.tolist()):
        members = torch.nonzero(labels == c).flatten()
        held += members[torch.randperm(len(members), generator=g)[:k]].tolist()
    return _partition(n, held)


def _partition(n: int, held: list[int]) -> tuple[list[int], list[int]]:
    held_set = set(held)
    return [i for i in range(n) if i not in held_set], sorted(held)


def carve(
    labels: Sequence[int] | Tensor | None, n: int, fractions: dict[str, float], seed: int
) -> dict[str, list[int]]:
    """{"train": indices, <name>: indices} of a pool of n samples for each split in `fractions` (test first);
    stratified by `labels`, or a seeded random split without."""
    index = list(range(n))
    out: dict[str, list[int]] = {}
    for name in (name for name in ("test", "val") if name in fractions):  # test from all, val from the rest
        fraction, flag = fractions[name], f"--data.init_args.{name}_fraction"
        if not 0 < fraction < 1:
            empty = " (1 or more leaves the train split empty)" if fraction >= 1 else ""
            raise ConfigError(
                f"There is no {name} split and {flag} is {fraction}: the {name} split is carved from the "
                f"training data, so it needs a share in (0, 1){empty}. Pass {flag} 0.1, or give a {name} "
                "split."
            )
        if labels is None:  # a seeded random split
            order = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed)).tolist()
            keep, held = _partition(len(index), order[: math.ceil(fraction * len(index))])
        else:
            try:
                keep, held = stratified_split([int(labels[i]) for i in index], fraction, seed)
            except ValueError as err:
                raise ConfigError(
                    f"Cannot hold out a stratified {name} split ({flag} {fraction}) from {len(index)} "
                    f"samples: {err} Change {flag}, give a {name} split, or add data."
                ) from err
        index, out[name] = [index[i] for i in keep], [index[i] for i in held]
    out["train"] = index
    return out
