"""Process-wide logging set-up for the command line and the supervisor's serving processes."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    """Log lines as they are (the access log is JSON already) on stderr at `level`; httpx's own
    line per health probe and /metrics scrape is kept out below `warning`. Records carry no
    caller, thread or process (nothing prints them)."""
    logging.basicConfig(level=level.upper(), format="%(message)s", stream=sys.stderr)
    # No format here or in uvicorn's reads a record's caller, thread or process: skip finding them
    # for every line (the logging HOWTO's "Optimization": findCaller alone walks the stack).
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
