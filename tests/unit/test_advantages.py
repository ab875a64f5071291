import pytest

from asyncrl.orchestrator.advantages import compute_advantages, is_zero_advantage


def test_group_relative():
    assert compute_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])


def test_std_normalised():
    adv = compute_advantages([1.0, 0.0], std_normalize=True)
    assert adv == pytest.approx([1.0, -1.0], rel=1e-5)


def test_zero_advantage_groups():
    assert is_zero_advantage(compute_advantages([0.3, 0.3, 0.3]))
    assert not is_zero_advantage(compute_advantages([0.3, 0.31]))
    assert compute_advantages([0.7], std_normalize=True) == [0.0]
    assert compute_advantages([]) == []
