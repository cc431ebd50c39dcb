"""Fixtures shared by every test folder."""
from __future__ import annotations

import signal

import pytest


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test, whatever this process inherited.

    A process started in the background by a shell without job control (``make test &``,
    ``nohup``) inherits SIGINT ignored, and then Python installs no handler: a test that
    sends SIGINT to simulate Ctrl-C would wait for nothing.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
