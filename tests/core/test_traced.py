"""A graph the legacy exporter unrolled for its example's values (an eager mixture of experts: a
loop over the experts the example routed to) is refused by plan, place and launch, naming the
Split and the fix; the same experts written as a gather export with torch.export and plan."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from cli_runner import run_cli
from onnx_builders import single_op_model
from torch import nn
from torch.nn import functional as F

from tessera.core.graph import load_graph
from tessera.core.traced import traced_values_message

HIDDEN, EXPERTS, TOP_K, WIDTH = 8, 4, 2, 16


class _Experts(nn.Module):
    """A mixture of experts after a residual: written as eager transformers code loops over the
    experts some token was routed to, or (``gathered``) as one product by each token's experts."""

    def __init__(self, gathered: bool) -> None:
        super().__init__()
        self.gathered = gathered
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, WIDTH, HIDDEN) * 0.3)
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, WIDTH) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, chosen = self.router(flat).softmax(-1).topk(TOP_K, dim=-1)
        if self.gathered:
            up = self.up[chosen.reshape(-1)]  # [N·k, W, H]
            h = torch.relu(up @ flat.repeat_interleave(TOP_K, 0).unsqueeze(-1))
            y = (self.down[chosen.reshape(-1)] @ h).squeeze(-1).reshape(-1, TOP_K, HIDDEN)
            return x + (y * weights.unsqueeze(-1)).sum(1).reshape(x.shape)
        out = torch.zeros_like(flat)
        mask = F.one_hot(chosen, EXPERTS).permute(2, 1, 0)  # [E, k, N]
        for hit in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
            slot, token = torch.where(mask[hit[0]])
            h = torch.relu(flat[token] @ self.up[hit[0]].T) @ self.down[hit[0]].T
            out = out.index_add(0, token, h * weights[token, slot, None])
        return x + out.reshape(x.shape)


def _export(module: nn.Module, path: Path, dynamo: bool) -> Path:
    torch.manual_seed(0)
    x = torch.randn(2, 6, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dims = {
                0: torch.export.Dim("batch", min=1, max=64),
                1: torch.export.Dim("sequence", min=2, max=32),
            }
            torch.onnx.export(
                module,
                (x,),
                str(path),
                dynamo=True,
                input_names=["x"],
                output_names=["y"],
                dynamic_shapes=(dims,),
            )
        else:
            axes = {"x": {0: "batch", 1: "sequence"}, "y": {0: "batch", 1: "sequence"}}
            torch.onnx.export(
                module, (x,), str(path), dynamo=False, opset_version=17, input_names=["x"], output_names=["y"],
                dynamic_axes=axes,
            )  # fmt: skip
    return path


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("experts")
    torch.manual_seed(0)
    looped = _Experts(gathered=False).eval()
    gathered = _Experts(gathered=True).eval()
    gathered.load_state_dict(looped.state_dict())
    return {
        "looped": _export(looped, folder / "looped.onnx", dynamo=False),
        "gathered": _export(gathered, folder / "gathered.onnx", dynamo=True),
    }


def test_the_unrolled_export_is_wrong_off_its_example_and_the_gathered_one_is_not(exports) -> None:
    """Why the refusal: on an input routed otherwise, the unrolled graph fails or differs from the
    module, while the gathered export computes it."""
    torch.manual_seed(0)
    module = _Experts(gathered=False).eval()
    x = torch.randn(1, 2, HIDDEN)  # 2 tokens reach at most 4 experts: rarely all, as the example did
    want = module(x).detach().numpy()
    got = ort.InferenceSession(str(exports["gathered"])).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(got, want, atol=1e-5)
    unrolled = ort.InferenceSession(str(exports["looped"]))
    try:
        wrong = unrolled.run(None, {"x": x.numpy()})[0]
    except Exception:  # noqa: BLE001 - onnxruntime refuses the baked Split sizes
        return
    assert not np.allclose(wrong, want, atol=1e-5)


def test_the_unrolled_split_is_found_and_a_fixed_split_is_not(exports) -> None:
    why = traced_values_message(load_graph(str(exports["looped"])))
    assert why is not None and "Split" in why and "NonZero" in why and "dynamo=True" in why
    assert traced_values_message(load_graph(str(exports["gathered"]))) is None
    halves = single_op_model("Split", [("x", (4, 6))], None, axis=1, num_outputs=2, opset=18)
    halves.graph.output.append(halves.graph.output[0])  # a second output, as Split has
    assert traced_values_message(load_graph(halves)) is None


@pytest.mark.parametrize(
    "command",
    [
        ("plan", "--kind", "gpp", "--cluster", "local-cpu-split", "--devices", "2", "--mini-batch", "4"),
        ("place", "--backends", "onnxruntime"),
    ],
    ids=["plan", "place"],
)
def test_plan_and_place_refuse_the_unrolled_export_naming_the_split(exports, command, tmp_path) -> None:
    result = run_cli(command[0], str(exports["looped"]), *command[1:], "-o", str(tmp_path / "out.json"))
    assert result.code == 2, result.err
    line = result.err.strip().splitlines()[-1]
    assert "Split" in line and "NonZero" in line and "Traceback" not in result.err
    assert not (tmp_path / "out.json").exists()


def test_the_gathered_export_plans_and_inspect_says_nothing_is_baked(exports, tmp_path) -> None:
    out = tmp_path / "gathered.gpp.json"
    result = run_cli(
        "plan", str(exports["gathered"]), "--kind", "gpp", "--cluster", "local-cpu-split", "--devices", "2",
        "--mini-batch", "4", "-o", str(out),
    )  # fmt: skip
    assert result.code == 0, result.err
    assert out.exists()
    assert '"traced_for_example": null' in run_cli("inspect", str(exports["gathered"]), "--json").out
