"""experiments/relock.py --code re-records the experiments' params only where a recorded value survives as it was."""

from helpers.scripts import load_script

relock = load_script("experiments/relock.py")


def test_an_added_key_is_no_change_and_a_changed_or_dropped_one_is():
    recorded = {"trainer": {"fabric": {"activation_checkpointing": True, "gpus": [0, 1]}, "lr": 1e-3}, "seed": 0}
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
