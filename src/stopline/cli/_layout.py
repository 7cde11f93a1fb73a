"""Tables that never break a value in the middle: every command's tables go through here.

A run id, a state or a tool name is one word, and a word is printed whole: an operator
copies it into the next command, and ``stopline runs | grep needs_review`` must find
it. So a table is laid out, in this order of preference:

- at its natural width, every cell on one line: always when stdout is not a terminal
  (a pipe, a file: lines are never wrapped for a width nobody sees), and on a terminal
  wide enough for it;
- on a narrower terminal, its cells wrapped at spaces only, each column at least as
  wide as its longest word;
- on a terminal narrower still, one block per row: the first cell, then each other
  column as ``HEADER: value`` on a line of its own (the terminal wraps what is longer).

Nothing is cut off and no column is dropped (rich's own table folded ``needs_review``
into ``needs_rev``/``iew``, and at 20 columns left out every column but the first).
"""

from __future__ import annotations

import dataclasses

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

from stopline.domain.limits import shown_whole

__all__ = ["Grid"]

_GAP = 2  # spaces between two columns (and one at each edge, as rich's tables have)


@dataclasses.dataclass(slots=True)
class Grid:
    """A table of text: ``columns`` are its headers; ``right`` names the columns whose
    cells align right (counts)."""

    columns: tuple[str, ...]
    title: str = ""
    right: frozenset[str] = frozenset()
    rows: list[tuple[str, ...]] = dataclasses.field(default_factory=list)

    def add_row(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{len(cells)} cells for {len(self.columns)} columns")
        # made printable here (control characters replaced), so widths are measured
        # on what the terminal will show
        self.rows.append(tuple(shown_whole("" if v is None else v) for v in cells))

    def print(self, console: Console) -> None:
        """Print it on ``console``, laid out for its width (see the module's doc)."""
        if self.title:
            console.print(Text(self.title, style="bold"))
        every = [self.columns, *self.rows]
        natural = [max(_widest(row[i]) for row in every) for i in range(len(self.columns))]
        room = console.width if console.is_terminal else None
        if room is None or _span(natural) <= room:
            self._lines(console, natural)
            return
        shortest = [max(_longest_word(row[i]) for row in every) for i in range(len(natural))]
        if _span(shortest) > room:
            self._blocks(console)
            return
        widths = list(shortest)
        spare = room - _span(widths)
        while spare > 0 and widths != natural:  # grow the columns that wrap, in turn
            for i, want in enumerate(natural):
                if spare and widths[i] < want:
                    widths[i] += 1
                    spare -= 1
        self._lines(console, widths)

    def _lines(self, console: Console, widths: list[int]) -> None:
        for index, row in enumerate([self.columns, *self.rows]):
            cells = [_wrap(cell, width) for cell, width in zip(row, widths, strict=True)]
            for n in range(max(len(lines) for lines in cells)):
                parts = []
                for name, lines, width in zip(self.columns, cells, widths, strict=True):
                    text = lines[n] if n < len(lines) else ""
                    pad = " " * (width - cell_len(text))
                    parts.append(pad + text if name in self.right and index else text + pad)
                line = (" " + (" " * _GAP).join(parts)).rstrip()
                console.print(Text(line, style="bold" if index == 0 else ""))

    def _blocks(self, console: Console) -> None:
        for row in self.rows:
            console.print(Text(row[0], style="bold"))
            for name, value in zip(self.columns[1:], row[1:], strict=True):
                if value:
                    console.print(f"  {name}: " + value.replace("\n", "\n    "))


def _span(widths: list[int]) -> int:
    return sum(widths) + _GAP * (len(widths) - 1) + 1


def _widest(cell: str) -> int:
    return max(cell_len(line) for line in cell.split("\n"))


def _longest_word(cell: str) -> int:
    return max((cell_len(word) for word in cell.split()), default=0)


def _wrap(cell: str, width: int) -> list[str]:
    """``cell`` in lines of at most ``width`` cells, broken at spaces only (``width`` is
    at least its longest word)."""
    lines: list[str] = []
    for hard in cell.split("\n"):
        if cell_len(hard) <= width:  # as it is, its spaces too
            lines.append(hard)
            continue
        line = ""
        for word in hard.split():
            if line and cell_len(line) + 1 + cell_len(word) > width:
                lines.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        lines.append(line)
    return lines
