"""Past the pins (pyproject.toml), a run says so in one line before it starts; it is not stopped."""

from importlib import metadata

import pytest

from project import versions


def installed(overrides: dict[str, str]):
    real = metadata.version
    return lambda name: overrides.get(name, real(name))


@pytest.mark.claim("past-the-pin-one-line")
def test_a_lightning_past_the_pin_is_one_line_naming_the_install(monkeypatch, capsys):
    assert versions.outside_pins() == []  # this environment: make install's pinned set
    monkeypatch.setattr(versions.metadata, "version", installed({"lightning": "2.7.0"}))
    (found,) = versions.outside_pins()
    assert found.startswith("lightning") and "<2.7" in found and "installed: 2.7.0" in found
    versions.warn_outside_pins()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-m pip install 'lightning" in err, err


def test_a_checkout_never_installed_compares_nothing():
    assert versions.outside_pins("no-such-distribution") == []


def test_the_default_run_knows_it_was_built_by_the_cli():
    from project.cli import build_cli

    cli = build_cli(["--trainer.logger", "false"], run=False)
    assert "model" in cli.model.hparams  # the nested model's config was saved: the CLI's record was found
