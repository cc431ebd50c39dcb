"""The output relay: linear in the output, bounded in memory, and what a terminal would show.

A rank may print a huge line without a newline, or redraw a progress bar with
``\\r`` for hours; neither may cost the launcher quadratic time or unbounded
memory. Complexity is judged by comparing sizes (CPU time of 16 MB against 4 MB),
never by a wall-clock threshold that a loaded machine could break.
"""
from __future__ import annotations

import time
import tracemalloc

import pytest

from mgpu_lab import launch
from mgpu_lab.launcher.relay import MAX_LINE, LineRelay

pytestmark = pytest.mark.timeout(180)
CHUNK = 65536  # what the launcher reads from a pipe at a time


class Sink:
    """A stream that keeps only what is needed to check the output: line count and sizes."""

    def __init__(self, keep: bool = False):
        self.lines, self.chars, self.keep, self.text = 0, 0, keep, []

    def write(self, s: str) -> None:
        self.lines += s.count("\n")
        self.chars += len(s)
        if self.keep:
            self.text.append(s)

    def flush(self) -> None:
        pass


def _feed(relay: LineRelay, data: bytes) -> None:
    for i in range(0, len(data), CHUNK):
        relay.feed(data[i:i + CHUNK])
    relay.close()


def _cpu_seconds(megabytes: int, unit: bytes) -> float:
    data = unit * (megabytes * 2**20 // len(unit))
    best = float("inf")
    for _ in range(3):  # the least of three: the cost of the work, not of the machine's load
        relay = LineRelay(0, 1, Sink)
        start = time.process_time()
        _feed(relay, data)
        best = min(best, time.process_time() - start)
    return best


@pytest.mark.parametrize("unit", [b"x", b"12%|####   |\r"], ids=["one long line", "progress bar redrawn with CR"])
def test_relaying_grows_linearly_with_the_output(unit):
    small, large = _cpu_seconds(4, unit), _cpu_seconds(16, unit)
    # 4x the output: about 4x the time when linear, 16x when quadratic.
    assert large / max(small, 1e-3) < 8, f"4 MB: {small:.3f} s, 16 MB: {large:.3f} s of CPU"


@pytest.mark.parametrize("unit", [b"x", b"12%|####   |\r"], ids=["one long line", "progress bar redrawn with CR"])
def test_memory_stays_bounded_while_32_mb_arrive_without_a_newline(unit):
    data = unit * (32 * 2**20 // len(unit))
    sink = Sink()
    relay = LineRelay(0, 1, lambda: sink)
    tracemalloc.start()
    try:
        for i in range(0, len(data), CHUNK):
            relay.feed(data[i:i + CHUNK])
        relay.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_LINE + 8 * CHUNK, f"peak {peak / 2**20:.1f} MiB for 32 MiB of output"


def test_a_line_longer_than_the_limit_comes_out_whole_in_prefixed_pieces():
    sink = Sink(keep=True)
    text = "".join(chr(ord("a") + i % 26) for i in range(3 * MAX_LINE + 5))
    _feed(LineRelay(1, 2, lambda: sink), text.encode())
    lines = "".join(sink.text).splitlines()
    assert len(lines) == 4 and all(line.startswith("[rank 1/2] ") for line in lines)
    assert "".join(line[len("[rank 1/2] "):] for line in lines) == text


@pytest.mark.parametrize("raw,shown", [
    (b"step 1\rstep 2\rstep 3\n", ["step 3"]),
    (b"windows line\r\n", ["windows line"]),  # CR LF: the text stays, as on a terminal
    (b" 10%\r 50%\r100%\r\ndone\n", ["100%", "done"]),
    (b"\r\r\n", [""]),
    (b"no newline at the end\r", ["no newline at the end"]),
    ("caf\u00e9 \u2713\n".encode()[:4], ["caf\ufffd"]),  # cut inside a character: replaced, not lost
])
def test_a_line_shows_what_a_terminal_shows_after_carriage_returns(raw, shown):
    sink = Sink(keep=True)
    relay = LineRelay(0, 1, lambda: sink)
    for b in raw:  # byte by byte: every split point of the stream
        relay.feed(bytes([b]))
    relay.close()
    assert "".join(sink.text).splitlines() == [f"[rank 0/1] {s}" for s in shown]


def _print_a_huge_line_and_a_bar(megabytes):
    import sys

    sys.stdout.write("y" * (megabytes * 2**20))
    sys.stdout.write("\n")
    for i in range(20000):
        sys.stdout.write(f"\r{i:6d}/20000")
    sys.stdout.write("\n")
    return "done"


def test_a_rank_printing_32_mb_without_a_newline_is_relayed_whole(capsys):
    assert launch(_print_a_huge_line_and_a_bar, 1, 32, timeout=150) == ["done"]
    out = capsys.readouterr().out.splitlines()
    pieces = [line for line in out if line.startswith("[rank 0/1] y")]
    assert sum(len(p) - len("[rank 0/1] ") for p in pieces) == 32 * 2**20
    assert out[-1] == "[rank 0/1]  19999/20000"


def test_a_rank_s_exception_raised_from_another_shows_its_cause_first_as_python_does():
    import types

    from mgpu_lab.launcher.errors import summary
    from mgpu_lab.launcher.rank import describe_exception
    from mgpu_lab.launcher.relay import format_traceback

    try:
        try:
            raise ValueError("the learner's own error")
        except ValueError as inner:
            raise RuntimeError("[Stage 1] failed to run forward") from inner
    except RuntimeError as exc:
        err = describe_exception(exc)
    text = format_traceback(err)
    assert (text.index("ValueError: the learner's own error") < text.index("The above exception was the direct cause")
            < text.index("RuntimeError: [Stage 1] failed to run forward")), text
    assert summary(types.SimpleNamespace(message=("error", err))) == (
        "raised RuntimeError: [Stage 1] failed to run forward (caused by ValueError: the learner's own error)")
