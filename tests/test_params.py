"""The methods' and models' parameters are declared as data (methods/params.py,
models/__init__.py) so that checking a configuration needs no torch; here they are held
to the classes' constructors, so the tables cannot drift from the code."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

import methods
import models
from methods import params

PIECES = [(f"{kind} {name}", piece)
          for kind, table in (("transport", params.TRANSPORTS), ("planner", params.PLANNERS),
                              ("scheduler", params.SCHEDULERS))
          for name, piece in table.items() if piece is not None]
PIECES.append(("ddp", params.DDP))
FAMILIES = [(name, family.target, family.params) for name, family in models.FAMILIES.items()]


def _constructor(cls: type, injected: tuple[str, ...]) -> list[tuple[str, object, object]]:
    """(name, type, default) of each argument of `cls` a configuration may give, in order."""
    hints = typing.get_type_hints(cls.__init__) if "__init__" in vars(cls) else {}
    return [(p.name, hints.get(p.name), p.default)
            for p in inspect.signature(cls).parameters.values() if p.name not in injected]


def _declared(table: type) -> list[tuple[str, object, object]]:
    hints = typing.get_type_hints(table)
    return [(f.name, hints[f.name],
             inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
            for f in dataclasses.fields(table)]


@pytest.mark.parametrize("what, piece", PIECES, ids=[w for w, _ in PIECES])
def test_a_pieces_declared_arguments_are_its_constructors(what: str, piece: params.Piece) -> None:
    cls = piece.load()
    assert _declared(piece.params) == _constructor(cls, piece.injected), what
    accepted = set(inspect.signature(cls).parameters)
    assert set(piece.injected) <= accepted, f"{what}: methods.build injects what it lacks"


@pytest.mark.parametrize("family, target, table", FAMILIES, ids=[f for f, _, _ in FAMILIES])
def test_a_model_familys_declared_arguments_are_its_constructors(family, target, table) -> None:
    assert _declared(table) == _constructor(models.family_class(family), ()), target


def test_every_class_of_the_methods_registries_is_declared() -> None:
    """The torch-side registries (methods.plan.PLANNERS, methods.sched.SCHEDULERS) name
    the same classes as the declared tables."""
    from methods.plan import PLANNERS
    from methods.sched import SCHEDULERS

    assert {n: p.load() for n, p in params.PLANNERS.items()} == PLANNERS
    assert {n: p.load() for n, p in params.SCHEDULERS.items()} == SCHEDULERS


def test_a_wrong_argument_type_is_named_from_the_declaration() -> None:
    assert methods.wrong_type(params.PSArgs, "partition_bytes", "abc") == "an integer"
    assert methods.wrong_type(params.PSArgs, "partition_bytes", True) == "an integer"
    assert methods.wrong_type(params.DDPArgs, "bucket_cap_mb", 25) is None  # an int is a number
    assert methods.wrong_type(params.PartitionArgs, "partition_elements", None) is None
    assert methods.wrong_type(params.MergedGroupsArgs, "fit_sizes", [1, 2]) is None
    assert methods.wrong_type(models.BertArgs, "dropout", "x") == "a number"
