"""Relaying rank output into the calling cell, and rendering rank errors.

Each rank's stdout and stderr arrive on pipes; :class:`LineRelay` cuts them
into lines, keeps only the last state of ``\\r``-updated lines (progress bars),
and writes each line prefixed ``[rank r/w]`` to the caller's matching stream,
in time linear in the output and bounded memory, however long a line gets.
"""
from __future__ import annotations

import codecs
import linecache
import re
import sys

_FAULT_FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+) in (?P<name>.+)$')


def prefix(rank: int, world_size: int) -> str:
    """The tag in front of every relayed line, e.g. ``[rank 1/4] ``."""
    return f"[rank {rank}/{world_size}] "


MAX_LINE = 1 << 20  # characters of one line kept before it is written out in pieces


class LineRelay:
    """Turns one rank stream's bytes into prefixed lines on ``target()``.

    Linear in the output and bounded in memory: a line is kept as a list of
    pieces (never re-concatenated as bytes arrive), a line longer than
    :data:`MAX_LINE` characters is written out in pieces of that size, and of a
    line redrawn with ``\\r`` (a progress bar) only the last state is kept, as a
    terminal shows it.
    """

    def __init__(self, rank: int, world_size: int, target):
        self._prefix = prefix(rank, world_size)
        self._target = target  # callable: the stream is looked up at write time
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._parts: list[str] = []  # the line's text after its last carriage return
        self._size = 0
        self._shown = ""  # the last non-empty text before a carriage return: shown if nothing follows

    def feed(self, data: bytes) -> None:
        """Add bytes read from the pipe; complete lines are written at once."""
        *done, rest = self._decoder.decode(data).split("\n")
        lines = []
        for piece in done:
            self._add(piece, lines)
            lines.append(self._take())
        self._add(rest, lines)
        if lines:
            self._write(lines)

    def close(self) -> None:
        """Flush a last line that had no newline."""
        lines: list[str] = []
        self._add(self._decoder.decode(b"", final=True), lines)
        if self._size or self._shown:
            lines.append(self._take())
        if lines:
            self._write(lines)

    def _add(self, text: str, lines: list[str]) -> None:
        if "\r" in text:
            first, *finished, text = text.split("\r")
            self._append(first, lines)
            if self._size:
                self._shown = "".join(self._parts)
            for seg in reversed(finished):  # a terminal shows the last non-empty state
                if seg:
                    self._shown = seg
                    break
            self._parts, self._size = [], 0
        self._append(text, lines)

    def _append(self, text: str, lines: list[str]) -> None:
        if not text:
            return
        self._parts.append(text)
        self._size += len(text)
        if self._size >= MAX_LINE:  # bounded: write the full pieces out as lines now
            whole = "".join(self._parts)
            cut = len(whole) - len(whole) % MAX_LINE
            lines.extend(whole[i:i + MAX_LINE] for i in range(0, cut, MAX_LINE))
            rest = whole[cut:]
            self._parts, self._size, self._shown = ([rest] if rest else []), len(rest), ""

    def _take(self) -> str:
        line = "".join(self._parts) if self._size else self._shown
        self._parts, self._size, self._shown = [], 0, ""
        return line

    def _write(self, lines: list[str]) -> None:
        stream = self._target()
        stream.write("".join(f"{self._prefix}{line}\n" for line in lines))
        stream.flush()


def stdout():
    return sys.stdout


def stderr():
    return sys.stderr


def _source(filename: str, lineno: int) -> str:
    # Cells of the calling kernel are in its linecache even though the rank had no source.
    return linecache.getline(filename, lineno).strip()


def format_traceback(err: dict) -> str:
    """Render a rank's exception description (from ``_rank.describe_exception``), its cause first.

    Source lines missing in the rank (functions defined in notebook cells) are
    filled in from the caller's linecache.
    """
    lines = []
    if err.get("cause"):  # as Python prints a chain: the cause first
        lines += [format_traceback(err["cause"]), "\nThe above exception was the direct cause of the following "
                  "exception:\n\n"]
    lines.append("Traceback (most recent call last):\n")
    frames = err["frames"]
    if frames and frames[0][2] == "rank_main":  # the launcher's own frame
        frames = frames[1:]
    for filename, lineno, name, line in frames:
        lines.append(f'  File "{filename}", line {lineno}, in {name}\n')
        text = line.strip() or _source(filename, lineno or 0)
        if text:
            lines.append(f"    {text}\n")
    lines.append(err["exception_only"])
    return "".join(lines)


def format_stack_dump(text: str) -> str:
    """Add source lines to a faulthandler dump where the caller knows them.

    Frames below the rank's entry point (the forkserver's machinery) are cut:
    the learner's frames are what explain a hang.
    """
    out, skipping = [], False
    for line in text.splitlines():
        if not line.startswith(" "):  # "Thread 0x... (most recent call first):"
            skipping = False
        elif skipping:
            continue
        if _FAULT_FRAME.match(line) and line.rstrip().endswith(" in rank_main"):
            skipping = True
            continue
        out.append(line)
        m = _FAULT_FRAME.match(line)
        if m:
            src = _source(m["file"], int(m["line"]))
            if src:
                out.append(f"    {src}")
    return "\n".join(out)
