"""Packing: FFD bins, row layout, truncation, and packed logprobs == unpacked logprobs (fp32, 1e-5)."""

import numpy as np
import pytest
import torch

from asyncrl.rollouts.packing import Sample, build_row, first_fit_decreasing, pack_samples, truncate


def test_first_fit_decreasing():
    bins = first_fit_decreasing([5, 3, 7, 2, 4, 1], capacity=8)
    assert sorted(i for b in bins for i in b) == list(range(6))
    assert all(sum([5, 3, 7, 2, 4, 1][i] for i in b) <= 8 for b in bins)
    assert len(bins) == 3  # 22 tokens need at least 3 rows of 8
    with pytest.raises(ValueError):
        first_fit_decreasing([9], capacity=8)


def test_row_layout():
    a = Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], advantage=0.5, temperature=0.7)
    b = Sample([6], [7], [-0.4], advantage=-1.0)
    row = build_row([a, b], length=8, pad_id=0)
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    assert row["loss_mask"].tolist() == [False, False, True, True, True, False, True, False]
    assert row["inference_logprobs"].tolist() == pytest.approx([0, 0, -0.1, -0.2, -0.3, 0, -0.4, 0])
    assert row["advantages"][:5].tolist() == [0.5] * 5 and row["advantages"][5:7].tolist() == [-1.0, -1.0]
    assert row["temperatures"][:5].tolist() == pytest.approx([0.7] * 5)


def test_truncate():
    s = Sample([1, 2, 3], [4, 5, 6, 7], [-1.0] * 4, 1.0)
    cut = truncate(s, 5)
    assert cut.completion_ids == [4, 5] and cut.meta["truncated"]
    assert truncate(s, 7) is s
    assert truncate(s, 3) is None


def test_rows_are_stacked_and_padded_to_a_multiple():
    samples = [Sample([1] * 3, [2] * (2 + i % 4), [-1.0] * (2 + i % 4), 1.0) for i in range(10)]
    mbs = pack_samples(samples, seq_len=16, pad_id=0, rows_per_micro_batch=3, pad_multiple=4)
    rows = sum(mb["input_ids"].shape[0] for mb in mbs)
    assert [mb["input_ids"].shape[0] for mb in mbs[:-1]] == [3] * (len(mbs) - 1)
    assert all(mb["input_ids"].shape[1] % 4 == 0 and mb["input_ids"].shape[1] <= 16 for mb in mbs)
    assert rows == len(first_fit_decreasing([len(s) for s in samples], 16))
    assert sum(int(mb["loss_mask"].sum()) for mb in mbs) == sum(len(s.completion_ids) for s in samples)


def test_pack_pads_to_rank_multiple():
    samples = [Sample([1], [2, 3], [-1.0, -1.0], 1.0) for _ in range(5)]
    mbs = pack_samples(samples, seq_len=6, pad_id=0, multiple_of=4, pad_multiple=2)
    assert len(mbs) % 4 == 0
    assert sum(int(mb["loss_mask"].sum()) for mb in mbs) == 10
    assert all(mb["input_ids"].shape[0] == 1 for mb in mbs)


def test_one_sample_per_row_for_context_parallelism():
    """Context parallelism attends over a whole row with a plain causal mask: every sample alone, longest
    first."""
    samples = [Sample([1] * 2, [2] * n, [-1.0] * n, 1.0) for n in (3, 9, 5)]
    mbs = pack_samples(samples, seq_len=16, pad_id=0, pad_multiple=4, one_per_row=True)
    assert [int(mb["loss_mask"].sum()) for mb in mbs] == [9, 5, 3]
    assert [mb["input_ids"].shape for mb in mbs] == [(1, 12), (1, 8), (1, 8)]
    # the sample, and its padding tail
    assert all(int((mb["position_ids"][0] == 0).sum()) <= 2 for mb in mbs)


@pytest.mark.parametrize(("rows_per_micro_batch", "truncated"), [(1, False), (3, False), (3, True)])
def test_packed_logprobs_equal_unpacked(micro_model, rows_per_micro_batch, truncated):
    """Each sample scores the same packed as alone; ``truncated``: every other sample was drawn under top-k /
    top-p / min-p, whose settings follow its tokens into whichever row and place they are packed at."""
    from transformers import AutoModelForCausalLM

    from asyncrl.trainer.forward import packed_logprobs

    model = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    samples = []
    for i in range(12):
        completion = rng.integers(6, 30, rng.integers(1, 9)).tolist()
        cut = {"top_k": 7, "top_p": 0.8, "min_p": 0.02} if truncated and i % 2 else {}
        samples.append(
            Sample(
                rng.integers(6, 30, rng.integers(2, 8)).tolist(),
                completion,
                [0.0] * len(completion),
                0.0,
                temperature=0.9,
                **cut,
            )
        )

    def completion_logprobs(mb):
        t = {k: torch.from_numpy(v) for k, v in mb.items()}
        return packed_logprobs(model, t)[t["loss_mask"][:, 1:]]  # row-major: the packer's order

    with torch.no_grad():
        mbs = pack_samples(samples, seq_len=48, pad_id=0, rows_per_micro_batch=rows_per_micro_batch)
        assert sum(mb["input_ids"].shape[0] for mb in mbs) < len(samples)  # several samples share each row
        packed = torch.cat([completion_logprobs(mb) for mb in mbs])
        # the same samples one per row, in the order the packer placed them
        order = [i for b in first_fit_decreasing([len(s) for s in samples], 48) for i in b]
        unpacked = torch.cat(
            [completion_logprobs(pack_samples([samples[i]], 48, 0, pad_multiple=1)[0]) for i in order]
        )
    torch.testing.assert_close(packed, unpacked, rtol=0, atol=1e-5)


def test_teacher_logprobs_are_packed_only_when_a_sample_has_them():
    a = Sample([1, 2], [3, 4], [-0.1, -0.2], 1.0, teacher_logprobs=[-1.5, -2.5])
    b = Sample([6], [7, 8, 9], [-0.4, -0.5, -0.6], 1.0)
    (mb,) = pack_samples([a, b], seq_len=16, pad_id=0, pad_multiple=8)
    assert mb["teacher_logprobs"].shape == mb["input_ids"].shape
    row, ids = mb["teacher_logprobs"][0].tolist(), mb["input_ids"][0].tolist()
    at = ids.index(3)  # a's completion
    assert row[at : at + 2] == pytest.approx([-1.5, -2.5])
    assert sum(abs(x) for x in row) == pytest.approx(4.0)  # b's tokens and the prompts: 0
    (plain,) = pack_samples([b], seq_len=16, pad_id=0, pad_multiple=8)
    assert "teacher_logprobs" not in plain
    assert truncate(a, 3).teacher_logprobs == [-1.5]
    with pytest.raises(ValueError):
        Sample([1], [2, 3], [-1.0, -1.0], 1.0, teacher_logprobs=[-1.0])


def test_truncation_is_packed_only_when_a_sample_has_one():
    a = Sample([1, 2], [3, 4], [-0.1, -0.2], 1.0, top_k=5, top_p=0.9, min_p=0.05)
    b = Sample([6], [7, 8, 9], [-0.4, -0.5, -0.6], 1.0)
    (mb,) = pack_samples([a, b], seq_len=16, pad_id=0, pad_multiple=8)
    ids = mb["input_ids"][0].tolist()
    # each sample's first token: its settings cover its prompt and completion
    at, bt = ids.index(1), ids.index(6)
    for key, value, neutral in (("top_ks", 5, 0), ("top_ps", 0.9, 1.0), ("min_ps", 0.05, 0.0)):
        row = mb[key][0].tolist()
        assert row[at : at + 4] == pytest.approx([value] * 4), key
        # b, then padding
        assert row[bt : bt + 4] == pytest.approx([neutral] * 4) and row[-1] == neutral, key
    (plain,) = pack_samples([b], seq_len=16, pad_id=0, pad_multiple=8)
    assert not {"top_ks", "top_ps", "min_ps"} & set(plain)
    assert (truncate(a, 3).top_k, truncate(a, 3).top_p, truncate(a, 3).min_p) == (5, 0.9, 0.05)
