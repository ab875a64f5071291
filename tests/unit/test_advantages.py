import pytest

from asyncrl.config.orchestrator import DifficultyConfig, OrchestratorConfig
from asyncrl.orchestrator.advantages import compute_advantages, drop_reason, is_zero_advantage


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


def reason(rewards, **difficulty):
    oc = OrchestratorConfig(difficulty=DifficultyConfig(**difficulty))
    return drop_reason(rewards, compute_advantages(rewards), oc)


@pytest.mark.parametrize(
    ("rewards", "expected"),
    [
        ([0.0, 0.0, 0.0, 0.0], "zero_advantage"),  # no signal: dropped first, whatever the filter says
        ([0.0, 0.0, 0.0, 0.1], "too_hard"),  # mean 0.025 < 0.05
        ([0.0, 0.0, 0.0, 0.2], None),  # mean 0.05: the bound itself is kept
        ([1.0, 1.0, 1.0, 0.9], "too_easy"),  # mean 0.975 > 0.95
        ([0.5, 0.5, 0.5, 0.6], "low_variance"),  # variance 0.001875 < 0.005 (the bound 0.05 above: 0.0075)
        ([0.0, 1.0, 0.0, 1.0], None),  # mean 0.5, variance 0.25
    ],
)
def test_difficulty_filter_reasons(rewards, expected):
    assert reason(rewards, enabled=True, min_reward_variance=0.005) == expected


def test_difficulty_filter_off_keeps_all_but_zero_advantage():
    assert reason([0.0, 0.0, 0.0, 0.1]) is None and reason([1.0, 1.0, 1.0, 0.9]) is None
    assert reason([0.2, 0.2]) == "zero_advantage"
    oc = OrchestratorConfig(drop_zero_advantage=False)
    assert drop_reason([0.2, 0.2], [0.0, 0.0], oc) is None
