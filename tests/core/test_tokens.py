"""Token-file training data: windows of the model's sequence with next-token labels, each window
once an epoch in a seeded order, memory-mapped; files that cannot train are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tessera.core.data import TrainingData
from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.core.tokens import TokenWindows
from tessera.models import build


def _tokens(tmp_path: Path, n: int, vocab: int = 100, suffix: str = ".npy") -> Path:
    ids = (np.arange(n) * 7 % vocab).astype(np.uint16 if suffix == ".bin" else np.int32)
    path = tmp_path / f"tokens{suffix}"
    if suffix == ".bin":
        ids.tofile(path)
    else:
        np.save(path, ids)
    return path


@pytest.mark.parametrize("suffix", [".npy", ".bin"])
def test_every_window_once_an_epoch_with_next_token_labels(tmp_path: Path, suffix: str) -> None:
    path = _tokens(tmp_path, 4 * 10 + 1, suffix=suffix)
    windows = TokenWindows(str(path), 4, 100, seed=3)
    assert windows.windows == 10
    tokens = np.asarray(windows.tokens)
    ids, labels = windows.batch(0, 10)  # one whole epoch
    starts = sorted(int(np.flatnonzero(tokens == row[0])[0]) for row in ids)
    assert starts == [4 * i for i in range(10)]
    np.testing.assert_array_equal(labels[:, :-1], ids[:, 1:])
    for row, label in zip(ids, labels, strict=True):
        start = int(np.flatnonzero(tokens == row[0])[0])
        np.testing.assert_array_equal(label, tokens[start + 1 : start + 5])
    again, _ = TokenWindows(str(path), 4, 100, seed=3).batch(0, 10)
    np.testing.assert_array_equal(ids, again)  # deterministic per seed
    other, _ = TokenWindows(str(path), 4, 100, seed=4).batch(0, 10)
    assert not np.array_equal(ids, other)
    later, _ = windows.batch(1, 10)  # the next epoch: the same windows, another order
    assert sorted(map(tuple, later)) == sorted(map(tuple, ids))


def test_files_that_cannot_train_are_refused_naming_them(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([1, 2, 300, 4, 5]))
    with pytest.raises(InputError, match="token 2 is id 300, outside the model's vocabulary 0..99") as err:
        TokenWindows(str(bad), 2, 100)
    assert err.value.source == str(bad)
    with pytest.raises(InputError, match="need at least 5"):
        TokenWindows(str(_tokens(tmp_path, 4)), 4, 100)
    flat = tmp_path / "grid.npy"
    np.save(flat, np.zeros((3, 3), dtype=np.int64))
    with pytest.raises(InputError, match="one flat array of integer ids"):
        TokenWindows(str(flat), 2, 100)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x00" * 7)
    with pytest.raises(InputError, match="uint16 ids"):
        TokenWindows(str(odd), 2, 100)


def test_a_decoder_draws_token_windows_and_labels_its_logits(tmp_path: Path) -> None:
    graph = load_graph(build("gpt", "tiny", seed=0))
    path = _tokens(tmp_path, 16 * 20 + 1, vocab=128)
    data = TrainingData(graph, 4, seed=1, path=str(path), loss="ce")
    inputs, targets = data.batch(0)
    assert inputs["input_ids"].shape == (4, 16) and inputs["input_ids"].dtype == np.int64
    np.testing.assert_array_equal(targets["logits"][:, :-1], inputs["input_ids"][:, 1:])
    with pytest.raises(InputError, match="with --loss ce, not mse"):
        TrainingData(graph, 4, path=str(path), loss="mse")
    tied = load_graph(build("mmt", "tiny", seed=0))
    with pytest.raises(InputError, match="token ids"):
        TrainingData(tied, 4, path=str(path), loss="ce")


def test_ids_reshaped_before_the_embedding_take_its_vocabulary() -> None:
    """An exporter may reshape the ids before the embedding's Gather (torch.onnx's dynamo exporter
    does): the vocabulary is still the table's rows (synthetic ids span it; a token file is checked
    against it)."""
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((50, 4)).astype(np.float32), "table"
    )
    shape = numpy_helper.from_array(np.array([-1, 8], dtype=np.int64), "shape")
    nodes = [
        helper.make_node("Reshape", ["input_ids", "shape"], ["view"]),
        helper.make_node("Gather", ["table", "view"], ["embedded"]),
        helper.make_node("ReduceMean", ["embedded"], ["logits"], axes=[2], keepdims=0),
    ]
    model = helper.make_model(
        helper.make_graph(
            nodes, "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [2, 8])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 8])], [table, shape],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )  # fmt: skip
    drawn, _ = TrainingData(load_graph(model), 4, seed=0).batch(0)
    assert drawn["input_ids"].max() < 50 and len(np.unique(drawn["input_ids"])) > 5
