"""Our INFO lines in Ray's worker processes, whose root logger stays at WARNING with no handler of
its own: without this, start-up facts (the engine's pool size, a replica's warm-up) were never shown."""

from __future__ import annotations

import logging
import sys

OUR_LOGGERS = ("radixserve", "engine", "cache", "routing", "deployments")


def show_our_info_logs() -> None:
    """Log our modules at INFO to stderr (which Ray writes to the worker's log and the driver's console)."""
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        if not logger.handlers:
            handler = logging.StreamHandler(sys.stderr)
            # (the time: Ray writes the line as it is, and a failure is found by when it happened)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False  # once, not again through a root handler some library adds
