"""Every YAML under configs/ parses and instantiates (as an overlay on default.yaml), like LHT's test_configs."""

import pytest

from project.cli import build_cli
from tests.conftest import CONFIGS

# Overrides that keep a config offline and small; the config itself stays as users run it.
OFFLINE = {"finetune.yaml": "model: {init_args: {model: {init_args: {weights: null}}}}"}
ALL = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml"))


@pytest.mark.claim("configs-overlay")
@pytest.mark.parametrize("name", ALL)
def test_config_instantiates(name, in_tmp):
    extra = []
    if name in OFFLINE:
        (in_tmp / "offline.yaml").write_text(OFFLINE[name])
        extra = ["--config", "offline.yaml"]
    cli = build_cli(["--config", str(CONFIGS / name), *extra], run=False)
    assert cli.model.num_classes == cli.datamodule.num_classes
    assert cli.trainer is not None


def test_there_is_a_default_and_debug_presets():
    assert "default.yaml" in ALL and any(n.startswith("debug/") for n in ALL)
