"""Messages that are not results go through `logging`: to stderr, above progress bars, rank 0 only.

Results (tables, summaries, the path written) are printed to stdout by each command; everything
else (warnings, notes on what a model assumed, progress remarks) is logged under `experiments`.
In the ranks of a run only rank 0 logs below WARNING, unless FLEXBENCH_LOG_ALL_RANKS=1.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import TypeVar

from tqdm import tqdm

__all__ = ["PROGRESS_DELAY_S", "configure_logging", "progress"]

# A bar shows only once its loop has run this long: a replay of seconds prints nothing.
PROGRESS_DELAY_S = 3.0

_LOGGER = "experiments"
T = TypeVar("T")


class _TqdmHandler(logging.Handler):
    """Write records with tqdm.write, so that they land above a live progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # logging must never take a run down
            self.handleError(record)


class _Formatter(logging.Formatter):
    """Plain text for notes; 'warning: ' or 'error: ' in front of the rest, '[rank R] ' in ranks."""

    def __init__(self, rank: int | None):
        super().__init__()
        self.prefix = "" if rank is None else f"[rank {rank}] "

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"{self.prefix}{level}{record.getMessage()}"


def configure_logging(rank: int | None = None) -> None:
    """Send the `experiments` loggers to stderr; in rank `rank` of a run, quiet unless rank 0."""
    logger = logging.getLogger(_LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = _TqdmHandler()
    handler.setFormatter(_Formatter(rank))
    logger.addHandler(handler)
    logger.propagate = False
    chatty = rank in (None, 0) or os.environ.get("FLEXBENCH_LOG_ALL_RANKS") == "1"
    logger.setLevel(logging.INFO if chatty else logging.WARNING)


def progress(iterable: Iterable[T] | None = None, *, total: int | None = None, desc: str,
             unit: str) -> tqdm:
    """A progress bar on stderr for a loop of replays, shown after PROGRESS_DELAY_S.

    Off where stderr is not a terminal (tqdm's disable=None) and under TQDM_DISABLE, which an
    explicit disable would otherwise override; left behind by nothing (leave=False).
    """
    off = os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no")
    return tqdm(iterable, total=total, desc=desc, unit=unit, delay=PROGRESS_DELAY_S,
                file=sys.stderr, disable=True if off else None, leave=False, dynamic_ncols=True)
