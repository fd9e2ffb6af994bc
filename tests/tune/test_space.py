"""Space and Symbol: enumeration, the create_symbol rules, dependent symbols, bad input."""

from __future__ import annotations

import itertools
import logging

import pytest

from slapo.tune import Space, Symbol, config_key


def test_static_space_is_the_product_in_creation_order():
    space = Space()
    space.create_symbol("batch_size", [8, 16, 32])
    space.create_symbol("ckpt", [True, False])
    cfgs = list(space)
    assert cfgs == [{"batch_size": b, "ckpt": c} for b in (8, 16, 32) for c in (True, False)]
    assert list(space) == cfgs  # iterating does not consume or fix the space
    assert not any(sym.is_fixed() for sym in space.space.values())


def test_create_symbol_keeps_fixed_and_recreates_unfixed():
    space = Space()
    a = space.create_symbol("a", [1, 2, 3])
    a.fix_at(1)
    assert space.create_symbol("a", [7, 8]) is a and a.value == 2
    b = space.create_symbol("b", [1, 2])
    b2 = space.create_symbol("b", [5])
    assert b2 is not b and space["b"].vals == [5]
    assert list(space.space) == ["a", "b"]


def test_clone_is_independent():
    space = Space()
    space.create_symbol("a", [1, 2])
    other = space.clone()
    other["a"].fix_at(1)
    other.create_symbol("b", [3])
    assert not space["a"].is_fixed() and "b" not in space
    assert other.to_dict() == {"a": 2, "b": 3}


def test_cfg_dict_to_str_and_key():
    assert Space.cfg_dict_to_str({"batch_size": 8, "ckpt_ratio": 0.5}) == (
        "batch_size=8, ckpt_ratio=0.5"
    )
    assert config_key({"b": 1, "a": 2}) == config_key({"a": 2, "b": 1})


def _dependent(args, space):
    gpus = args["gpus"]
    tp = space.create_symbol("tp", [t for t in (1, 2, 4, 8) if gpus % t == 0])
    dp = gpus // tp.value
    space.create_symbol("batch_size", [b for b in (dp, 2 * dp, 4 * dp, 32) if b <= 16])
    if tp.value > 1:  # only exists in some branches
        space.create_symbol("sequence_parallel", [False, True])
    space.create_symbol("ckpt", [0.0, 1.0])
    return space


def test_dependent_symbols_enumerate_every_valid_config_once():
    cfgs = list(Space(_dependent, {"gpus": 4}))
    expected = []
    for tp in (1, 2, 4):
        dp = 4 // tp
        for bs in [b for b in (dp, 2 * dp, 4 * dp, 32) if b <= 16]:
            for sp in [False, True] if tp > 1 else [None]:
                for ckpt in (0.0, 1.0):
                    cfg = {"tp": tp, "batch_size": bs}
                    if sp is not None:
                        cfg["sequence_parallel"] = sp
                    cfg["ckpt"] = ckpt
                    expected.append(cfg)
    assert cfgs == expected
    assert len({config_key(c) for c in cfgs}) == len(cfgs)


def test_update_space_is_called_with_the_args():
    assert {c["tp"] for c in Space(_dependent, {"gpus": 2})} == {1, 2}


def test_empty_candidates_prune_a_branch():
    def update(args, space):
        a = space.create_symbol("a", [1, 2, 3])
        space.create_symbol("b", [b for b in (1, 2, 3) if a.value + b <= 3])

    assert list(Space(update)) == [{"a": 1, "b": 1}, {"a": 1, "b": 2}, {"a": 2, "b": 1}]


def test_brute_force_equivalence_on_a_filtered_product():
    def update(args, space):
        a = space.create_symbol("a", list(range(4)))
        b = space.create_symbol("b", [b for b in range(4) if b >= a.value])
        space.create_symbol("c", [c for c in range(4) if (a.value + b.value + c) % 2 == 0])

    got = list(Space(update))
    want = [
        {"a": a, "b": b, "c": c}
        for a, b, c in itertools.product(range(4), repeat=3)
        if b >= a and (a + b + c) % 2 == 0
    ]
    assert got == want


def test_log_space_logs_and_returns_every_config(caplog):
    with caplog.at_level(logging.INFO, logger="slapo.tune"):
        cfgs = Space().log_space({"gpus": 2}, _dependent)
    assert cfgs == list(Space(_dependent, {"gpus": 2}))
    assert f"{len(cfgs)} configurations" in caplog.text
    assert "tp=2, batch_size=1, sequence_parallel=False, ckpt=0.0" in caplog.text


@pytest.mark.parametrize(
    ("name", "vals", "err", "word"),
    [
        ("batch size", [1], TypeError, "name"),
        (3, [1], TypeError, "name"),
        ("bs", "abc", TypeError, "vals"),
        ("bs", 4, TypeError, "vals"),
        ("bs", [[1, 2]], TypeError, "vals"),
        ("bs", [1, 1], ValueError, "duplicate"),
    ],
)
def test_bad_symbols_raise_typed_errors_naming_the_argument(name, vals, err, word):
    with pytest.raises(err, match=word):
        Space().create_symbol(name, vals)


def test_symbol_fix_at_checks_range_and_value_before_fixing():
    sym = Symbol("bs", range(3))
    assert sym.value == 0 and not sym.is_fixed()
    with pytest.raises(IndexError, match="idx=3"):
        sym.fix_at(3)


def test_bad_update_space():
    with pytest.raises(TypeError, match="update_space"):
        Space(update_space=42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="update_space must return"):
        list(Space(lambda args, space: Space()))
