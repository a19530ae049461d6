"""llama-server's per-line limits for code completion, as /infill clients rely on them:

- `n_indent`: a line after the first that starts (its first non-blank character) at
  less than this indentation ends the generation, cut before that character: a
  suggestion stays inside the block the cursor is in;
- `t_max_predict_ms`: once this much wall time has passed since the first token, the
  next token that ends a line ends the generation: an editor gets whole lines within
  its time budget, and the first line is always finished.

Pure text and a clock; the engine's Output feeds it each token's text.
"""

from __future__ import annotations

import time

from localspec.core.events import StopReason


class LineLimits:
    def __init__(self, n_indent: int = 0, t_max_predict_ms: float = 0) -> None:
        self.n_indent = max(0, n_indent)
        self.budget_s = max(0.0, t_max_predict_ms) / 1000.0
        self.t0: float | None = None  # when the first token was picked (Generation.start)
        self._past_first_line = False
        self._indent: int | None = None  # blanks so far at the start of the line; None past them

    @property
    def active(self) -> bool:
        return self.n_indent > 0 or self.budget_s > 0

    def feed(self, text: str) -> tuple[str, StopReason | None]:
        """(the text to keep, why generation ends here: INDENT, TIME or None)."""
        if self.n_indent > 0:
            cut = self._indent_cut(text)
            if cut is not None:
                return text[:cut], StopReason.INDENT
        if "\n" in text and self.budget_s > 0 and self.t0 is not None:
            if time.perf_counter() - self.t0 > self.budget_s:
                return text, StopReason.TIME
        return text, None

    def _indent_cut(self, text: str) -> int | None:
        for i, c in enumerate(text):
            if c == "\n":
                self._past_first_line, self._indent = True, 0
            elif self._indent is not None and self._past_first_line:
                if c in " \t":
                    self._indent += 1
                else:
                    short = self._indent < self.n_indent
                    self._indent = None
                    if short:
                        return i
        return None
