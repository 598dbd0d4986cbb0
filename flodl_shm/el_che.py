"""ElChe: the heterogeneous-cadence balancer (flodl 0.7.0, ``notes/flodl-spec.md`` §8)."""
from __future__ import annotations

import enum


class Phase(str, enum.Enum):
    """ElChe lifecycle phase; values are the JSON names used in checkpoint metadata.

    Phases only move forward: Probe -> Warmup (first calibration) -> Stable
    (5 calibrations) -> Mature (20 calibrations).
    """

    PROBE = "probe"
    WARMUP = "warmup"
    STABLE = "stable"
    MATURE = "mature"

    def __str__(self) -> str:
        return self.value
