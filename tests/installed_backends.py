"""Load a registered attention backend for a test, or skip the test when it is not installed here."""

from __future__ import annotations

import pytest

from dovetail.plugin_manager import get_plugin_manager


def installed_attention_backend(name: str):
    """The backend class registered as ``name``; skips with its reason when ``available()`` gives one."""
    backend = get_plugin_manager().registry.attention_backends[name].load()
    reason = backend.available()
    if reason:
        pytest.skip(reason)
    return backend
