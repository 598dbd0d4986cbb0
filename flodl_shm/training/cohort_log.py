"""One log line per cohort decision, from one rank.

ElChe's cadence, the convergence guard's verdicts and the coordinator's plans are
computed identically on every rank from the same gathered numbers: logged by each, every
decision would read once per rank in the launcher's log (under ``torchrun``, N identical
lines). :func:`log_cohort_decisions_from` makes only the *reporting rank* (the lowest
live one) log them. One filter per process, on the ``flodl_shm`` logger those modules
log through; the training built last in a process names its reporter.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

#: the modules whose records are cohort decisions
DECISION_MODULES = frozenset({"el_che", "convergence", "coordinator"})


class _CohortDecisionFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.is_reporter: Optional[Callable[[], bool]] = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.module not in DECISION_MODULES or self.is_reporter is None:
            return True
        return self.is_reporter()


_FILTER: Optional[_CohortDecisionFilter] = None


def log_cohort_decisions_from(is_reporter: Callable[[], bool]) -> None:
    """From now on, ElChe's, the guard's and the coordinator's records pass only where
    ``is_reporter()`` is true (on the reporting rank)."""
    global _FILTER
    if _FILTER is None:
        _FILTER = _CohortDecisionFilter()
        logging.getLogger("flodl_shm").addFilter(_FILTER)
    _FILTER.is_reporter = is_reporter
