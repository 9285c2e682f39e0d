"""Process-wide logging set-up for the command line and the supervisor's serving processes."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    """Log lines as they are (the access log is JSON already) on stderr at `level`; httpx's own
    line per health probe and /metrics scrape is kept out below `warning`."""
    logging.basicConfig(level=level.upper(), format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
