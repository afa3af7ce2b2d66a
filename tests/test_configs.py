"""Every YAML under configs/ parses and instantiates (as an overlay on default.yaml), like LHT's test_configs."""

import pytest

from project.cli import build_cli
from tests.conftest import CONFIGS

ALL = sorted(str(p.relative_to(CONFIGS)) for p in CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("name", ALL)
def test_config_instantiates(name, in_tmp):
    cli = build_cli(["--config", str(CONFIGS / name)], run=False)
    assert cli.model.num_classes == cli.datamodule.num_classes
    assert cli.trainer is not None


def test_there_is_a_default_and_debug_presets():
    assert "default.yaml" in ALL and any(n.startswith("debug/") for n in ALL)
