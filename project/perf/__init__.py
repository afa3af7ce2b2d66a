"""The opt-in door: speed-ups that rely on Lightning's private names (`configs/fast_cpu.yaml` turns them on).

The default config runs on Lightning's public API only. What is here shaves host time per step, which matters on
small models trained on CPUs and hardly on a GPU busy with real work; `make bench` measures it (option
`fast_cpu`). Each speed-up is guarded: when a Lightning release renames or reshapes what it relies on, that
speed-up turns itself off with one warning naming it, and the run goes on at Lightning's own speed.
"""

from project.perf.lean_hooks import LeanHooks

__all__ = ["LeanHooks"]
