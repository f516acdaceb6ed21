"""A plain-text progress bar on stderr (no dependency), and one-line status updates.

On a terminal it redraws one line; otherwise (CI logs, a remote command's captured output) it
prints a line at every 5% so the log shows progress without thousands of carriage returns.
``status_line`` is the same rule for a caller that writes its own progress text: a carriage
return only where the stream is a terminal. No other module of tileq writes one.
"""

from __future__ import annotations

import sys
import time


def is_terminal(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def status_line(text: str, stream=None) -> None:
    """Show ``text`` as the current progress: redrawn in place on a terminal (end with
    ``end_status``), else written as a line of its own."""
    stream = stream if stream is not None else sys.stderr
    stream.write(f"\r{text}\033[K" if is_terminal(stream) else text + "\n")
    stream.flush()


def end_status(stream=None) -> None:
    """End a run of ``status_line`` calls (a newline after the last redrawn line on a terminal)."""
    stream = stream if stream is not None else sys.stderr
    if is_terminal(stream):
        stream.write("\n")
        stream.flush()


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
        self.tty = is_terminal(self.stream)
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

    def note(self, text: str) -> None:
        """A message line (a failure, a warning) between progress lines, the bar redrawn after it."""
        if self.enabled and self.tty:
            self.stream.write("\r" + text + " " * max(self._last_len - len(text), 0) + "\n")
            self._last_len = 0
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
