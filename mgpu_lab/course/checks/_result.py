"""What a check returns: :class:`CheckResult`, shown as HTML in Jupyter and text elsewhere."""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field


@dataclass
class Case:
    """One judged case of an exercise.

    Attributes:
        name: what the case checks, in words.
        passed: whether the learner's code passed it.
        hidden: hidden cases report only pass/fail, never their details.
        expected, got: the values compared (text), when the case compares values.
        hint: what the likely bug is, shown when the case fails.
        points: what the case is worth (1 unless the checker gives the lesson's idea more, 0 for practice).
    """

    name: str
    passed: bool
    hidden: bool = False
    expected: str = ""
    got: str = ""
    hint: str = ""
    points: int = 1

    @property
    def worth(self) -> str:
        """`` (3 points)`` after the name of a case worth more than one point, `` (practice, no points)`` after
        one worth none (an exercise that only turns the text into code keeps few points), else nothing."""
        if self.points == 0:
            return " (practice, no points)"
        return f" ({self.points} points)" if self.points != 1 else ""

    def lines(self) -> list[str]:
        mark = "PASS" if self.passed else "FAIL"
        if self.hidden:
            return [f"{mark}  hidden case: {self.name}{self.worth}"]
        out = [f"{mark}  {self.name}{self.worth}"]
        if not self.passed:
            if self.expected or self.got:
                out += [f"      expected: {self.expected}", f"      got:      {self.got}"]
            if self.hint:
                out.append(f"      hint: {self.hint}")
        return out


@dataclass
class CheckResult:
    """The verdict on one exercise.

    Attributes:
        exercise: the exercise id, e.g. ``"01.pick_device"``.
        passed: True when every case passed.
        points, max_points: points earned and available (one per case unless a case is worth more).
        status: ``"passed"``, ``"failed"``, ``"not attempted"``, or ``"recorded"`` (saved for
            a grader, which judges it after the notebook has run).
        messages: one line per case (details of failed visible cases included).
        cases: the judged cases.
    """

    exercise: str
    points: int
    max_points: int
    status: str
    cases: list[Case] = field(default_factory=list)
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def messages(self) -> list[str]:
        out = [self.note] if self.note else []
        for case in self.cases:
            out += case.lines()
        return out

    def summary(self) -> str:
        """One line that reads the same way round for everyone: the points, then the verdict.

        ``01.pick_device: 6/6 points · passed``, ``01.pick_device: 5/6 points · not yet``,
        ``01.pick_device: 0/6 points · not attempted`` (a fraction followed by "failed" read as
        "5 of 6 failed").
        """
        if self.status == "recorded":
            return f"{self.exercise}: recorded for grading"
        verdict = {"passed": "passed", "failed": "not yet"}.get(self.status, self.status)
        return f"{self.exercise}: {self.points}/{self.max_points} points · {verdict}"

    def __str__(self) -> str:
        return "\n".join([self.summary(), *("  " + m for m in self.messages)])

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        colour = {"passed": "#1a7f37", "failed": "#cf222e"}.get(self.status, "#9a6700")
        rows = []
        for case in self.cases:
            mark = "&#10004;" if case.passed else "&#10008;"
            tint = "#1a7f37" if case.passed else "#cf222e"
            name = ("hidden case: " if case.hidden else "") + html.escape(case.name + case.worth)
            detail = ""
            if not case.passed and not case.hidden:
                bits = []
                if case.expected or case.got:
                    bits.append(f"expected <code>{html.escape(case.expected)}</code>, "
                                f"got <code>{html.escape(case.got)}</code>")
                if case.hint:
                    bits.append(f"<b>hint:</b> {html.escape(case.hint)}")
                detail = "<br>" + "<br>".join(bits)
            rows.append(f'<li><span style="color:{tint}">{mark}</span> {name}{detail}</li>')
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        return (
            f'<div class="mgpu-check mgpu-check-{self.status.replace(" ", "-")}" '
            f'style="border-left:4px solid {colour};padding:4px 10px">'
            f'<b style="color:{colour}">{html.escape(self.summary())}</b>{note}'
            f'<ul style="margin:4px 0">{"".join(rows)}</ul></div>'
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data
