"""What a weights update holds, read from safetensors headers and manifests before anything loads
(asyncrl.inference.vllm.weights_check): every way a file can be cut or altered is named, a shape or dtype the
starting model does not have is named, and a whole file passes."""

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.inference.vllm.weights_check import (
    directory_entries,
    header_entries,
    manifest_entries,
    reference_entries,
    signature_problems,
)


@pytest.fixture
def weights(tmp_path):
    state = {"a.weight": torch.zeros(4, 3), "b.bias": torch.ones(5, dtype=torch.bfloat16)}
    save_file(state, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


def test_a_whole_file_lists_its_tensors(weights):
    assert sorted(header_entries(weights)) == [("a.weight", "float32", [4, 3]), ("b.bias", "bfloat16", [5])]
    assert reference_entries(weights.parent)["a.weight"] == ("a.weight", "float32", [4, 3])
    assert reference_entries(weights.parent / "nowhere") is None  # a hub id: the workers' check alone
    save_file({"lm_head.weight": torch.zeros(2, 2)}, weights.parent / "head.safetensors")
    (weights.parent / "config.json").write_text('{"tie_word_embeddings": true}')
    # re-tied by the loader: an update may omit it
    assert "lm_head.weight" not in reference_entries(weights.parent)


def rewrite_header(path, edit):
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-8]), "truncated"),
        (lambda p: p.write_bytes(p.read_bytes() + b"\0"), "the file has"),
        (lambda p: p.write_bytes(b"\x05\0\0"), "shorter than a safetensors header"),
        (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}"), "its header claims"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{no}"), "not JSON"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"[]"), "not a JSON object"),
        (lambda p: rewrite_header(p, lambda h: h["a.weight"].update(dtype="F99")), "is not dtype, shape"),
        (lambda p: rewrite_header(p, lambda h: h["a.weight"].update(shape=[4, 4])), "need another span"),
        (lambda p: rewrite_header(p, lambda h: h["a.weight"].update(shape=[-4, -3])), "is not dtype, shape"),
    ],
)
def test_a_damaged_file_is_named_with_what_is_wrong(weights, damage, words):
    damage(weights)
    with pytest.raises(ValueError, match=words) as e:
        directory_entries(weights.parent)
    assert str(e.value).startswith("model.safetensors")


def test_a_name_held_twice_across_files_is_refused(weights):
    save_file({"a.weight": torch.zeros(4, 3)}, weights.parent / "more.safetensors")
    with pytest.raises(ValueError, match="held twice"):
        directory_entries(weights.parent)


def test_manifests_are_read_as_the_same_entries():
    good = {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}
    assert manifest_entries(good) == [("a", "bfloat16", [2, 3])]
    for bad in (
        {**good, "shapes": [[2, 3], [1]]},
        {**good, "dtype_names": ["complex7"]},
        {**good, "shapes": [[2, -1]]},
        {"names": "a", "dtype_names": [], "shapes": []},
    ):
        with pytest.raises(ValueError, match="manifest"):
            manifest_entries(bad)


def test_shapes_and_dtype_kinds_are_checked_against_the_starting_model(weights):
    reference = reference_entries(weights.parent)
    fits = [
        ("a.weight", "bfloat16", [4, 3]),
        ("b.bias", "float32", [5]),
        ("experts.fused", "bfloat16", [2, 2]),
    ]
    assert signature_problems(fits, reference) == []  # another float width, and a name left to the workers
    assert signature_problems(fits, None) == []
    left_out = signature_problems(fits[:1], reference)  # the starting model's layout, less a tensor
    assert left_out == ["1 tensors of the served model are not in the update (first: ['b.bias'])"]
    wrong = [("a.weight", "float32", [3, 4]), ("b.bias", "int32", [5])]
    assert signature_problems(wrong, reference) == [
        "a.weight has shape [3, 4], the served model's is [4, 3]",
        "b.bias is int32, the served model's is bfloat16",
    ]


class Loads(torch.nn.Module):
    """A model with vLLM's ``load_weights`` contract: each name to its parameter through a loader that checks
    the shape before it copies (vLLM's ``default_weight_loader``), an unknown name a ``KeyError``; returns
    the names it loaded."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 4)

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            param = params[name]
            assert param.size() == tensor.size(), (
                f"Attempted to load weight ({tensor.size()}) into ({param.size()})"
            )
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded


def test_the_workers_dry_run_loads_nothing_and_names_what_does_not_fit():
    from asyncrl.inference.vllm.worker import dry_run_problems

    model = Loads()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    good = [("proj.weight", "bfloat16", [4, 3]), ("proj.bias", "bfloat16", [4])]
    assert dry_run_problems(model, good, quantized=False) == []
    cases = {
        "Attempted to load weight": [("proj.weight", "bfloat16", [3, 4]), good[1]],
        "KeyError": [*good, ("proj.extra", "bfloat16", [1])],
        "are not in the update (first: ['proj.bias'])": good[:1],
        "not floating point": [good[0], ("proj.bias", "int64", [4])],
    }
    for words, entries in cases.items():
        (problem,) = dry_run_problems(model, entries, quantized=False)
        assert words in problem, (words, problem)
    for name, p in model.named_parameters():  # the same storage, untouched, on its device
        assert p.device.type == "cpu" and p.data_ptr() == before[name][0] and torch.equal(p, before[name][1])


class ReadsValues(Loads):
    """A loader that reads a value of what it loads (a quantized scale): not checkable on the meta device."""

    def load_weights(self, weights):
        for _, tensor in weights:
            tensor.sum().item()
        return super().load_weights([])


def test_a_model_whose_loaders_read_values_is_left_to_the_header_checks():
    from asyncrl.inference.vllm.worker import dry_run_problems

    entries = [("proj.weight", "bfloat16", [4, 3]), ("proj.bias", "bfloat16", [4])]
    assert dry_run_problems(ReadsValues(), entries, quantized=False) == []
