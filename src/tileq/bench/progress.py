"""A plain-text progress bar on stderr (no dependency).

On a terminal it redraws one line; otherwise (CI logs, a remote command's captured output) it
prints a line at every 5% so the log shows progress without thousands of carriage returns.
"""

from __future__ import annotations

import sys
import time


def _fmt_s(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    def __init__(self, total: int, *, title: str = "", stream=None, enabled: bool = True,
                 width: int = 28):
        self.total = max(int(total), 0)
        self.title = title
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.total > 0
        self.width = width
        self.done = 0
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._next_log = 0.0
        self._last_len = 0

    def line(self, label: str = "") -> str:
        frac = self.done / self.total if self.total else 1.0
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        head = f"{self.title} " if self.title else ""
        text = (f"{head}[{bar}] {self.done}/{self.total} {frac:4.0%} "
                f"{_fmt_s(elapsed)} elapsed, eta {_fmt_s(eta)}")
        return text + (f"  {label}" if label else "")

    def advance(self, label: str = "", step: int = 1) -> None:
        self.done = min(self.done + step, self.total)
        if not self.enabled:
            return
        text = self.line(label)
        if self.tty:
            pad = max(self._last_len - len(text), 0)
            self.stream.write("\r" + text + " " * pad)
            self._last_len = len(text)
        else:
            frac = self.done / self.total
            if frac + 1e-9 < self._next_log and self.done != self.total:
                return
            self._next_log = frac + 0.05
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
