"""What every multi-process gloo test module starts with: torch.distributed, torch.multiprocessing, its marks."""

import pytest

dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

#: ``pytestmark = GLOO_MARKS`` in a module of tests that spawn gloo ranks.
GLOO_MARKS = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with gloo is not available"),
]


def on_gloo_ranks(test):
    """The marks of a test that spawns gloo ranks, on that test alone (a module's other tests need none)."""
    for mark in GLOO_MARKS:
        test = mark(test)
    return test
