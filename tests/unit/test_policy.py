"""The async bound: which policy may generate step n, for async_level k = 0, 1, 2."""

import pytest

from asyncrl.transport.policy import check_bound, choose_policy, min_policy


@pytest.mark.parametrize("k", [0, 1, 2])
def test_min_policy(k):
    assert [min_policy(n, k) for n in range(5)] == [max(0, n - k) for n in range(5)]


def test_k0_is_on_policy():
    assert choose_policy(0, 0, False, []) == 0
    assert choose_policy(3, 0, False, [1, 2]) is None  # must wait for weights/step_3
    assert choose_policy(3, 0, False, [1, 2, 3]) == 3


def test_k1_and_k2_take_the_newest_allowed():
    assert choose_policy(1, 1, False, []) == 0
    assert choose_policy(3, 1, False, [1]) is None
    assert choose_policy(3, 1, False, [1, 2]) == 2
    assert choose_policy(3, 1, False, [1, 2, 3]) == 3  # newer than required is fine
    assert choose_policy(4, 2, False, [1]) is None
    assert choose_policy(4, 2, False, [1, 2]) == 2


@pytest.mark.parametrize("k", [0, 1, 2])
def test_strict_uses_exactly_n_minus_k(k):
    available = list(range(1, 10))
    for n in range(8):
        assert choose_policy(n, k, True, available) == max(0, n - k)
    assert choose_policy(5, k, True, [s for s in available if s != max(0, 5 - k)]) in (None, 0)


def test_trainer_check():
    check_bound(5, 1, False, [4])
    check_bound(5, 1, False, [5])
    with pytest.raises(RuntimeError, match="requires between 4 and 5"):
        check_bound(5, 1, False, [3])
    with pytest.raises(RuntimeError, match="exactly 3"):
        check_bound(5, 2, True, [4])
    check_bound(5, 2, True, [3])
    with pytest.raises(RuntimeError):
        check_bound(0, 0, False, [1])  # a policy from the future is a bug too
