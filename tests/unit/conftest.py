"""Fixtures of the unit tests."""

import os

import pytest


@pytest.fixture
def no_packscore_env(monkeypatch):
    """A PACKSCORE_ variable of the shell running the tests changes nothing (``Settings`` reads
    them): ``pytestmark = pytest.mark.usefixtures("no_packscore_env")`` where settings are built."""
    for name in list(os.environ):
        if name.startswith("PACKSCORE_"):
            monkeypatch.delenv(name)
