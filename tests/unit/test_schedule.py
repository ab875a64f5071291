import pytest

from asyncrl.config.trainer import SchedulerConfig
from asyncrl.trainer.optim import lr_factor


def test_constant_with_warmup():
    cfg = SchedulerConfig(name="constant", warmup_steps=4)
    assert [lr_factor(s, cfg, 10) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_linear_and_cosine_reach_min_ratio():
    for name in ("linear", "cosine"):
        cfg = SchedulerConfig(name=name, min_lr_ratio=0.1)
        assert lr_factor(0, cfg, 10) == pytest.approx(1.0)
        assert lr_factor(10, cfg, 10) == pytest.approx(0.1)
    assert lr_factor(5, SchedulerConfig(name="linear"), 10) == pytest.approx(0.5)
    assert lr_factor(5, SchedulerConfig(name="cosine"), 10) == pytest.approx(0.5)
