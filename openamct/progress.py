"""Progress of a step that can run for minutes (create, save, auto_decomposition, the latency
search, distill): a tqdm bar on a terminal, INFO log lines otherwise.

The bar appears only once the step has run ``delay`` seconds, and a log line only every
``every`` seconds (and a last one when the step took that long), so a step that ends quickly
shows nothing either way. The library never prints: the bar is tqdm's, on stderr.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Progress"]


class Progress:
    """``with Progress("save", total=5, logger=logger) as p: ...; p.update(what="export")``."""

    def __init__(self, desc: str, total: int | None = None, *, logger: logging.Logger, unit: str = "step",
                 delay: float = 2.0, every: float = 10.0) -> None:
        self.desc, self.total, self.logger, self.every = desc, total, logger, every
        self.n = 0
        self._start = self._last = time.monotonic()
        self._bar = None
        stream = sys.stderr
        if stream is not None and hasattr(stream, "isatty") and stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, delay=delay, leave=False, file=stream)

    def _text(self, what: str | None) -> str:
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        return (f"{self.desc}: {count}{f' ({what})' if what else ''}, "
                f"{time.monotonic() - self._start:.0f} s")

    def update(self, n: int = 1, what: str | None = None) -> None:
        """``n`` more done; ``what`` names the part just done or now running."""
        self.n += n
        if self._bar is not None:
            if what:
                self._bar.set_postfix_str(what, refresh=False)
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self.logger.info("%s", self._text(what))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif time.monotonic() - self._start >= self.every:
            self.logger.info("%s: done", self._text(None))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
