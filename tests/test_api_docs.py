"""The public Python API documents itself as networkx's algorithms do: numpydoc sections with examples."""

from __future__ import annotations

import inspect

import pytest

import dcsched

FUNCTIONS = sorted(name for name in dcsched.__all__
                   if not name.startswith("_") and inspect.isfunction(getattr(dcsched, name)))


def test_the_public_functions_are_the_ones_users_call():
    assert {"load", "save", "schedule", "simulate", "capture", "shard", "backend"} <= set(FUNCTIONS)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_public_function_has_parameters_returns_and_examples(name):
    doc = inspect.getdoc(getattr(dcsched, name)) or ""
    for section in ("Parameters\n----------", "Examples\n--------"):
        assert section in doc, f"dcsched.{name}'s docstring has no {section.splitlines()[0]} section"
    if inspect.signature(getattr(dcsched, name)).return_annotation not in ("None", None):
        assert "Returns\n-------" in doc, f"dcsched.{name}'s docstring has no Returns section"
