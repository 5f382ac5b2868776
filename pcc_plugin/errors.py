"""Errors that end the daemon: the message alone tells the operator what to fix."""

from __future__ import annotations


class FatalError(Exception):
    """The daemon cannot go on; the message says what to fix."""
