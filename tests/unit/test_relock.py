"""experiments/relock.py --code re-records the experiments' params only where a recorded value survives as it
was."""

from helpers.scripts import load_script

relock = load_script("experiments/relock.py")


def test_an_added_key_is_no_change_and_a_changed_or_dropped_one_is():
    recorded = {
        "trainer": {"fabric": {"activation_checkpointing": True, "gpus": [0, 1]}, "lr": 1e-3},
        "seed": 0,
    }
    added = {"trainer": {"fabric": {"activation_checkpointing": True, "activation_checkpointing_every": 1,
                                    "gpus": (0, 1)}, "lr": 1e-3}, "seed": 0}  # fmt: skip
    assert relock.changed_params(recorded, added) == []
    changed = {"trainer": {"fabric": {"activation_checkpointing": False, "gpus": [0, 1]}}, "seed": 1}
    assert relock.changed_params(recorded, changed) == [
        "trainer.fabric.activation_checkpointing",
        "trainer.lr (dropped)",
        "seed",
    ]
    # a section that became a value, and the reverse
    assert relock.changed_params({"a": {"b": 1}}, {"a": 1}) == ["a"]
    assert relock.changed_params({"a": 1}, {"a": {"b": 1}}) == ["a"]


def test_a_key_that_moved_with_its_value_is_no_change_and_one_that_moved_and_changed_is():
    recorded = {"weights": {"transport": "filesystem", "nccl_host": "127.0.0.1", "nccl_port": 0}}
    moved = {"weights": {"transport": "filesystem", "nccl": {"host": "127.0.0.1", "port": 0}}}
    assert relock.changed_params(relock.moved_to_new_keys(recorded), moved) == []
    assert relock.changed_params(recorded, moved) == [
        "weights.nccl_host (dropped)",
        "weights.nccl_port (dropped)",
    ]
    other = {"weights": {"transport": "filesystem", "nccl": {"host": "10.0.0.1", "port": 0}}}
    assert relock.changed_params(relock.moved_to_new_keys(recorded), other) == ["weights.nccl.host"]
    assert recorded["weights"]["nccl_host"] == "127.0.0.1"  # the recorded value itself is left as it was
