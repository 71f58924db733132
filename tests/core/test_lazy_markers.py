"""A lazy parameter's markers are checked where the model is read: a value the generator cannot
honour is refused (exit 2 at inspect, plan and validate), never defaulted or left to a worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_runner import run_cli

from tessera.core.errors import InputError
from tessera.core.graph import load_graph
from tessera.core.weights import lazy_values
from tessera.models import build

CASES = {
    "unknown init": ("tessera.init", "evil", "tessera.init 'evil' is not normal, ones or zeros"),
    "nan std": ("tessera.std", "nan", "tessera.std nan is not a finite number >= 0"),
    "negative std": ("tessera.std", "-1", "is not a finite number >= 0"),
    "word std": ("tessera.std", "big", "tessera.std 'big' is not a number"),
    "seed": ("tessera.seed", "1.5", "tessera.seed '1.5' is not an integer"),
    "missing seed": ("tessera.seed", None, "lacks tessera.seed"),
    "slice axis 7": ("tessera.slice", "SRC;64,64;7;0;32", "on axis 7 of"),
    "slice past its source": ("tessera.slice", "SRC;64,64;0;32;96", "which is not its dims"),
    "slice text": ("tessera.slice", "garbage", "is not SOURCE;D0,D1;AXIS;START;STOP"),
}


def _lazy_model() -> onnx.ModelProto:
    return build("gpt", "tiny", lazy=True)


def _edited(key: str, value: str | None) -> tuple[onnx.ModelProto, str]:
    model = _lazy_model()
    tensor = next(t for t in model.graph.initializer if len(t.dims) == 2)
    entries = {e.key: e.value for e in tensor.external_data}
    if key == "tessera.slice" and value is not None:
        rows, cols = tensor.dims
        value = value.replace("64,64", f"{rows},{cols}").replace("SRC", tensor.name)
        value = value.replace(";0;32;96", f";0;{rows // 2};{rows + 32}").replace(
            ";7;0;32", f";7;0;{rows // 2}"
        )
    if value is None:
        entries.pop(key)
    else:
        entries[key] = value
    del tensor.external_data[:]
    for k, v in entries.items():
        tensor.external_data.add(key=k, value=v)
    return model, tensor.name


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_markers_are_refused_when_the_model_is_read(tmp_path: Path, case: str) -> None:
    key, value, fragment = CASES[case]
    model, name = _edited(key, value)
    path = tmp_path / "lazy.onnx"
    onnx.save(model, path)
    with pytest.raises(InputError) as info:
        load_graph(str(path))
    line = info.value.one_line()
    assert line.startswith(f"{path}: lazy parameter {name!r}") and fragment in line, line
    result = run_cli("inspect", str(path))
    assert result.code == 2 and "Traceback" not in result.err and name in result.err


def test_good_markers_still_generate_the_eager_values() -> None:
    eager = {
        t.name: onnx.numpy_helper.to_array(t) for t in build("gpt", "tiny", lazy=False).graph.initializer
    }
    for tensor in _lazy_model().graph.initializer:
        if tensor.external_data:
            np.testing.assert_array_equal(lazy_values(tensor), eager[tensor.name])
