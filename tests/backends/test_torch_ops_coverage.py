"""The operator table's coverage: every schema version it implements is run by some case of the
family tests, and docs/operators.md is what the generator writes (so the page cannot go stale)."""

from __future__ import annotations

import importlib
from pathlib import Path

import onnx
import pytest

from tessera.backends.torch_ops import MAX_OPSET, OPS, schema_version, schema_versions
from tessera.backends.torch_ops.coverage import coverage_table, reason

FAMILY_TESTS = sorted(
    p.stem for p in Path(__file__).parent.glob("test_torch_ops_*.py") if p.stem != Path(__file__).stem
)


def _tested_versions() -> dict[str, set[int]]:
    tested: dict[str, set[int]] = {}
    for stem in FAMILY_TESTS:
        for c in importlib.import_module(f"backends.{stem}").CASES:
            tested.setdefault(c.op, set()).update(schema_version(c.op, o) for o in c.tested_opsets())
    return tested


def test_every_implemented_schema_version_is_tested() -> None:
    tested = _tested_versions()
    untested = {
        op: sorted(set(schema_versions(op)) - tested.get(op, set()))
        for op in OPS
        if set(schema_versions(op)) - tested.get(op, set())
    }
    assert not untested, f"schema versions without a case: {untested}"
    assert all(schema_versions(op) for op in OPS), "an operator with no schema version in the opsets"


# New attributes of schema versions after MAX_OPSET, each checked by its function.
LATER_ATTRIBUTES = {
    ("Cast", "round_mode"),  # only for float8e8m0, an element type torch_dtype refuses
    ("CastLike", "round_mode"),
    ("Range", "stash_type"),  # 1 (float), as arange computes; float16 accumulation is refused
    ("SpaceToDepth", "mode"),  # anything but DCR is refused
    ("Attention", "left_window_size"),  # a window other than -1 (none) is refused
    ("Attention", "right_window_size"),
}
# New inputs of schema versions after MAX_OPSET, each refused by its function when given.
LATER_INPUTS = {"Attention"}  # 24: nonpad_kv_seqlen (a KV cache's valid lengths)


def test_later_schema_versions_change_only_types_or_checked_attributes() -> None:
    """The executor runs opsets after MAX_OPSET on the same functions: in the installed onnx, no
    later version of a supported operator changes its inputs, outputs or attributes unchecked."""
    changed = []
    for s in onnx.defs.get_all_schemas_with_history():
        if s.domain not in ("", "ai.onnx") or s.name not in OPS or s.since_version <= MAX_OPSET:
            continue
        newest = onnx.defs.get_schema(s.name, MAX_OPSET, "")
        added = set(s.attributes) - set(newest.attributes)
        names, known = [i.name for i in s.inputs], [i.name for i in newest.inputs]
        grown = s.name in LATER_INPUTS and names[: len(known)] == known
        if (names != known and not grown) or len(s.outputs) != len(newest.outputs):
            changed.append(f"{s.name}-{s.since_version}: inputs or outputs")
        changed += [f"{s.name}-{s.since_version}: {a}" for a in added if (s.name, a) not in LATER_ATTRIBUTES]
    assert not changed, changed


def test_the_coverage_page_is_current() -> None:
    page = Path(__file__).parents[2] / "docs" / "operators.md"
    assert page.read_text() == coverage_table(), "run: python -m tessera.backends.torch_ops.coverage"


@pytest.mark.parametrize(
    ("op_type", "why"),
    [
        ("Loop", "control flow"),
        ("RandomNormalLike", "random"),
        ("QLinearConv", "quantized"),
        ("SplitToSequence", "sequences"),
        ("Upsample", "deprecated"),
        ("Swish", "introduced after opset 23"),
        ("LSTM", "recurrent"),
    ],
)
def test_refused_operators_say_why(op_type: str, why: str) -> None:
    assert op_type not in OPS and why in reason(op_type)
