"""NoProfiler (project/profiler.py): the default config's profiler records nothing and hands Lightning one shared
no-op context per call; any other profiler replaces it."""

import contextlib

from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

from project.cli import CONFIG_DIR, build_cli
from project.profiler import NoProfiler
from tests.conftest import quiet_trainer


def test_the_default_config_runs_with_no_profiler_and_a_named_one_replaces_it():
    default = build_cli(["--config", str(CONFIG_DIR / "default.yaml")], run=False)
    assert type(default.trainer.profiler) is NoProfiler
    simple = build_cli(["--config", str(CONFIG_DIR / "debug/profiler.yaml")], run=False)
    assert type(simple.trainer.profiler) is SimpleProfiler
    # Lightning's default
    lightning_default = build_cli(["--trainer.profiler", "null"], run=False)
    assert type(lightning_default.trainer.profiler) is PassThroughProfiler


class CountingNoProfiler(NoProfiler):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.contexts: set[int] = set()

    def profile(self, action_name: str) -> contextlib.AbstractContextManager:
        context = super().profile(action_name)
        self.calls.append(action_name)
        self.contexts.add(id(context))
        return context


def test_lightning_wraps_every_hook_in_it_and_gets_one_shared_context_that_nests(tmp_path):
    profiler = CountingNoProfiler()
    trainer = quiet_trainer(
        max_epochs=1, limit_train_batches=3, limit_val_batches=1, profiler=profiler, default_root_dir=tmp_path
    )
    trainer.fit(BoringModel())
    assert trainer.profiler is profiler
    # Lightning asked for a context at every step's hooks: the per-step work this profiler makes cheaper.
    assert sum(name.endswith("on_train_batch_start") for name in profiler.calls) >= 3
    assert sum(name.endswith("on_before_optimizer_step") for name in profiler.calls) >= 3
    assert len(profiler.contexts) == 1  # one object, whatever the action
    assert profiler.summary() == ""  # nothing recorded
    with profiler.profile("outer"), profiler.profile("inner"):  # nested use, as Lightning's hooks do
        pass
