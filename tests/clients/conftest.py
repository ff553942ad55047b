"""Fixtures shared by the client tests: the real client trees (tests/clients/client_tree.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from clients.client_tree import ClientUnavailable, ensure


@pytest.fixture(scope="session")
def vllm_tree() -> Path:
    """vLLM 0.33's pure-Python tree (fetched once); the test skips with pip's reason when it cannot be."""
    try:
        return ensure("vllm")
    except ClientUnavailable as exc:
        pytest.skip(f"vLLM 0.33's Python tree could not be fetched: {exc}")
