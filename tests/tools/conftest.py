"""Fixtures of the bench/sm12x_model.py tests: the module freshly imported and the document it
builds from the stored results, once per test module."""

from __future__ import annotations

import pytest
from bench_modules import RESULTS, fresh


@pytest.fixture(scope="module")
def sm():
    return fresh("sm12x_model")


@pytest.fixture(scope="module")
def doc(sm):
    return sm.build(RESULTS)
