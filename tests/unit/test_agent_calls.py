"""An agent's recorded calls as branches: a conversation that appends is one stream; one that re-templates
starts another, and no sampled token is trained twice or under a prompt it was not sampled from."""

from __future__ import annotations

from asyncrl.rollouts.calls import Endpoint, assemble


def call(prompt: list[int], completion: list[int]) -> dict:
    return {"prompt_ids": prompt, "completion_ids": completion, "logprobs": [-0.5] * len(completion)}


def test_calls_that_append_to_the_history_are_one_stream_with_the_inserted_tokens_as_context():
    calls = [call([1, 2], [3, 4]), call([1, 2, 3, 4, 9, 9], [5]), call([1, 2, 3, 4, 9, 9, 5, 8], [6, 7])]
    (branch,), restarts = assemble(calls)
    assert restarts == 0
    assert branch.prompt_ids == [1, 2]
    assert branch.completion_ids == [3, 4, 9, 9, 5, 8, 6, 7]
    assert branch.completion_mask == [True, True, False, False, True, False, True, True]
    assert branch.completion_logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5, 0.0, -0.5, -0.5]


def test_a_call_that_rewrites_the_history_starts_a_stream_of_its_own_and_is_counted():
    calls = [call([1, 2], [3, 4]), call([1, 7, 3], [5]), call([1, 7, 3, 5, 6], [8])]
    branches, restarts = assemble(calls)
    assert restarts == 1
    assert [(b.prompt_ids, b.completion_ids, b.completion_mask) for b in branches] == [
        ([1, 2], [3, 4], [True, True]),
        ([1, 7, 3], [5, 6, 8], [True, False, True]),  # the third call continues the second's stream
    ]


def test_a_call_extends_the_longest_stream_it_continues_and_forks_are_their_own_stream():
    # two sub-agents share a system prompt: the second call does not extend the first's completion
    calls = [call([1], [2]), call([1], [3]), call([1, 2, 4], [5]), call([1, 3, 6], [7])]
    branches, restarts = assemble(calls)
    assert restarts == 1
    assert [b.completion_ids for b in branches] == [[2, 4, 5], [3, 6, 7]]
    # every sampled token is trained exactly once
    trained = [t for b in branches for t, m in zip(b.completion_ids, b.completion_mask, strict=True) if m]
    assert sorted(trained) == [2, 3, 5, 7]


def test_no_calls_no_branches():
    assert assemble([]) == ([], 0)


def test_the_endpoint_names_every_variable_frameworks_read():
    env = Endpoint("http://h:1/rollouts/k/v1", "key", "policy").env()
    assert env["OPENAI_BASE_URL"] == env["OPENAI_API_BASE"] == "http://h:1/rollouts/k/v1"
    assert env["OPENAI_API_KEY"] == "key" and env["OPENAI_MODEL"] == "policy"
