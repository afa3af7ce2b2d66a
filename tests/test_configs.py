"""Every YAML under configs/ parses and instantiates (as an overlay on default.yaml), like LHT's test_configs."""

import pytest

from project.cli import build_cli
from tests.conftest import CONFIGS

# Overrides that keep a config offline and small; the config itself stays as users run it.
OFFLINE = {"finetune.yaml": "model: {init_args: {model: {init_args: {weights: null}}}}"}
# configs/sweep/ holds sweep files (a search space, not a trainer config): checked below, by their keys.
ALL = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml") if p.parent.name != "sweep")
SWEEPS = sorted(str(p.relative_to(CONFIGS)) for p in (CONFIGS / "sweep").glob("*.yaml"))


@pytest.mark.claim("configs-overlay")
@pytest.mark.parametrize("name", ALL)
def test_config_instantiates(name, in_tmp):
    extra = []
    if name in OFFLINE:
        (in_tmp / "offline.yaml").write_text(OFFLINE[name])
        extra = ["--config", "offline.yaml"]
    cli = build_cli(["--config", str(CONFIGS / name), *extra], run=False)
    # The data's values reached the arguments the module has (a classifier's classes, another task's shape)
    if "num_classes" in cli.model.hparams:
        assert cli.model.hparams.num_classes == cli.datamodule.num_classes
    else:
        assert tuple(cli.model.hparams.input_shape) == tuple(cli.datamodule.input_shape)
    assert cli.trainer is not None


def test_there_is_a_default_and_debug_presets():
    assert "default.yaml" in ALL and any(n.startswith("debug/") for n in ALL)


@pytest.mark.claim("sweep-results")
@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_file_names_keys_the_training_config_has(name, in_tmp):
    """A shipped sweep file's dotted keys, at both ends of their ranges, overlay default.yaml as `make train` would."""
    import yaml

    from project.sweep.space import load_space

    space = load_space(CONFIGS / name)  # its sampler and pruner built too
    for end in ("low", "high"):
        values = {k: spec[end] if end in spec else spec["choices"][0] for k, spec in space.params.items()}
        (in_tmp / "trial.yaml").write_text(yaml.safe_dump({**space.fixed, **values}))
        cli = build_cli(["--config", str(CONFIGS / "default.yaml"), "--config", "trial.yaml"], run=False)
        for key, value in values.items():
            node = cli.config
            for part in key.split("."):
                node = node[part]
            assert node == value, f"{name}: {key} did not reach the config"
