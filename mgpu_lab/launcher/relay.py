"""Relaying rank output into the calling cell, and rendering rank errors.

Each rank's stdout and stderr arrive on pipes; :class:`LineRelay` cuts them
into lines, keeps only the last state of ``\\r``-updated lines (progress bars),
and writes each line prefixed ``[rank r/w]`` to the caller's matching stream.
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


class LineRelay:
    """Turns one rank stream's bytes into prefixed lines on ``target()``."""

    def __init__(self, rank: int, world_size: int, target):
        self._prefix = prefix(rank, world_size)
        self._target = target  # callable: the stream is looked up at write time
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> None:
        """Add bytes read from the pipe; complete lines are written at once."""
        text = self._pending + self._decoder.decode(data)
        *lines, self._pending = text.split("\n")
        if lines:
            self._write(lines)

    def close(self) -> None:
        """Flush a last line that had no newline."""
        tail = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        if tail:
            self._write([tail])

    def _write(self, lines: list[str]) -> None:
        stream = self._target()
        # A carriage return redraws the line in a terminal: keep what a terminal shows.
        out = "".join(f"{self._prefix}{line.rsplit(chr(13), 1)[-1]}\n" for line in lines)
        stream.write(out)
        stream.flush()


def stdout():
    return sys.stdout


def stderr():
    return sys.stderr


def _source(filename: str, lineno: int) -> str:
    # Cells of the calling kernel are in its linecache even though the rank had no source.
    return linecache.getline(filename, lineno).strip()


def format_traceback(err: dict) -> str:
    """Render a rank's exception description (from ``_rank.describe_exception``).

    Source lines missing in the rank (functions defined in notebook cells) are
    filled in from the caller's linecache.
    """
    lines = ["Traceback (most recent call last):\n"]
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
