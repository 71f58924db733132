"""The pattern language: composition, constraints, alternatives, commutativity, convexity."""

from __future__ import annotations

import pytest

from tessera.backends.patterns import find_matches, is_constant, is_convex, is_op, wildcard

CONV = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}


@pytest.fixture(scope="module")
def block(make_graph):
    """conv → add(·, skip) → relu, plus a sigmoid branch off the conv joining at the end."""
    return make_graph(
        [
            ("conv", "Conv", ["x", "w"], ["c"], CONV),
            ("add", "Add", ["c", "skip"], ["a"]),
            ("relu", "Relu", ["a"], ["r"]),
            ("sig", "Sigmoid", ["c"], ["s"]),
            ("mul", "Mul", ["r", "s"], ["y"]),
        ],
        {"x": [1, 4, 8, 8], "skip": [1, 4, 8, 8]},
        ["y"],
        {"w": [4, 4, 3, 3]},
    )


def test_paper_pattern_matches_conv_add_relu(block) -> None:
    conv = is_op("Conv")(wildcard(), wildcard()).has_attr({"kernel_shape": [3, 3]})
    pattern = is_op("Relu")(is_op("Add")(conv, wildcard()))
    assert pattern.match(block, "relu") == {"conv", "add", "relu"}
    assert pattern.match(block, "add") is None  # the root must be a Relu
    assert find_matches(block, pattern) == [frozenset({"conv", "add", "relu"})]


def test_constraints(block) -> None:
    assert is_op("Conv").has_attr({"kernel_shape": [1, 1]}).match(block, "conv") is None
    assert is_op("Conv").has_shape((1, 4, 8, 8)).match(block, "conv") == {"conv"}
    assert is_op("Conv").has_shape((1, None, 8, 8)).match(block, "conv") == {"conv"}
    assert is_op("Conv").has_shape((1, 4, 8)).match(block, "conv") is None
    assert is_op("Conv").has_dtype("float32").match(block, "conv") == {"conv"}
    assert is_op("Conv").has_dtype("float16").match(block, "conv") is None
    assert is_op("Conv").where(lambda op: op.flops > 0).match(block, "conv") == {"conv"}
    assert is_op("Conv").where(lambda op: op.flops < 0).match(block, "conv") is None
    # Weights: is_constant matches an initializer, not an activation.
    assert is_op("Conv")(wildcard(), is_constant()).match(block, "conv") == {"conv"}
    assert is_op("Conv")(is_constant(), wildcard()).match(block, "conv") is None
    # More arguments than inputs: no match; fewer: the rest are free.
    assert is_op("Relu")(wildcard(), wildcard()).match(block, "relu") is None
    assert is_op("Conv")(wildcard()).match(block, "conv") == {"conv"}


def test_alternatives_and_commutativity(block) -> None:
    act = is_op("Relu") | is_op("Sigmoid")
    assert act.match(block, "relu") == {"relu"}
    assert act.match(block, "sig") == {"sig"}
    assert act.match(block, "conv") is None
    assert (is_op("Relu", "Sigmoid")(is_op("Conv"))).match(block, "sig") == {"sig", "conv"}
    # mul(r, s) written as mul(sigmoid, relu) still matches (Mul is commutative).
    swapped = is_op("Mul")(is_op("Sigmoid")(wildcard()), is_op("Relu")(wildcard()))
    assert swapped.match(block, "mul") == {"mul", "sig", "relu"}
    # An alternative called with arguments calls each alternative.
    assert (is_op("Add") | is_op("Mul"))(is_op("Conv"), wildcard()).match(block, "add") == {"add", "conv"}


def test_whole_block_is_convex_and_matches(block) -> None:
    conv = is_op("Conv")(wildcard(), wildcard())
    pattern = is_op("Mul")(is_op("Relu")(is_op("Add")(conv, wildcard())), is_op("Sigmoid")(conv))
    assert pattern.match(block, "mul") == {"conv", "add", "relu", "sig", "mul"}


def test_non_convex_match_is_rejected(block) -> None:
    # mul(relu(·), sigmoid(conv)) without add: {mul, relu, sig, conv} leaves through add and re-enters at relu.
    pattern = is_op("Mul")(is_op("Relu")(wildcard()), is_op("Sigmoid")(is_op("Conv")))
    assert not is_convex(block, {"mul", "relu", "sig", "conv"})
    assert pattern.match(block, "mul") is None
    # The convex parts on their own are fine.
    assert is_op("Mul")(is_op("Relu")(wildcard()), is_op("Sigmoid")(wildcard())).match(block, "mul") == {
        "mul",
        "relu",
        "sig",
    }


def test_is_convex(block) -> None:
    assert is_convex(block, set())
    assert is_convex(block, {"add"})
    assert is_convex(block, {"conv", "add", "relu"})
    assert is_convex(block, {"conv", "sig"})
    assert not is_convex(block, {"conv", "relu"})  # conv → add → relu leaves the set
    assert not is_convex(block, {"conv", "mul"})
    assert is_convex(block, {"conv", "add", "relu", "sig", "mul"})


def test_patterns_on_a_zoo_model(gpt) -> None:
    linear = is_op("Add")(is_op("MatMul")(wildcard(), is_constant()), is_constant())
    matches = find_matches(gpt, linear)
    # q, k, v, out, fc1, fc2 in each of the two layers, and the head if it has a bias.
    assert len(matches) >= 12
    assert frozenset({"layer0/ffn/fc1/matmul", "layer0/ffn/fc1/bias_add"}) in matches
    assert all(is_convex(gpt, m) for m in matches)


def test_bad_use() -> None:
    with pytest.raises(ValueError):
        is_op()
    with pytest.raises(TypeError):
        is_op("Relu")(is_op("Conv"))(wildcard())
    with pytest.raises(TypeError):
        wildcard()(wildcard())
