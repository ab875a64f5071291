"""The suite's rule for components a machine may lack: skipped elsewhere, a failure under CI=true."""

import pytest

from helpers.required import require


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_component_fails_under_ci(monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="SLURM must be testable under CI=true.*not installed"):
        require("SLURM is not installed", "SLURM")


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_a_missing_component_skips_elsewhere(monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception, match="not installed"):
        require("SLURM is not installed", "SLURM")
    require(None, "SLURM")  # present: the test goes on
