"""Shared fixtures."""
from __future__ import annotations

import pytest

from flodl_shm.cluster import wire


@pytest.fixture
def payload_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of every payload buffer the frame reader allocates during the test.

    Wraps the real ``wire._alloc_payload`` (the reader's one allocation point);
    allocation itself is unchanged.
    """
    sizes: list[int] = []
    real = wire._alloc_payload

    def recording(nbytes: int):
        sizes.append(nbytes)
        return real(nbytes)

    monkeypatch.setattr(wire, "_alloc_payload", recording)
    return sizes
