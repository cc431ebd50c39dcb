"""Several scenarios of a check in one launch of real ranks, and each rank's evidence per scenario.

In the ranks, :func:`run_scenarios` runs every scenario and saves each rank's
outcomes as it goes; in the kernel, :func:`launch_scenarios` launches them once
and hands out the evidence case by case (:class:`Scenarios`), judging what the
ranks did before a scenario failed.

Example:
    >>> evidence = Scenarios([[("ok", 1.5), ("ok", 2.0)], [("ok", 1.5), ("raised", "ValueError", "no samples")]])
    >>> evidence.complete, evidence.get(None, 0)
    (1, [1.5, 1.5])
"""
from __future__ import annotations

import os
import torch
import torch.distributed as tdist

from .outcome import raised_outcome


# -- several scenarios in one launch -----------------------------------------------------
def run_scenarios(log_dir, one, scenarios) -> list:
    """Run ``one(scenario)`` for each scenario in this rank; save the evidence so far after each.

    A rank that raises in a scenario saves its outcome (:func:`.outcome.raised_outcome`) and
    raises on (so the launch fails fast); :func:`read_scenarios` then recovers what
    every rank did before, and the checker judges those scenarios all the same.
    """
    path = os.path.join(log_dir, f"rank{tdist.get_rank()}.pt")
    done = []
    for scenario in scenarios:
        try:
            done.append(("ok", one(scenario)))
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 - saved as this scenario's outcome, then raised on
            done.append(raised_outcome(exc))
            torch.save(done, path)
            raise
        torch.save(done, path)
    return done


def read_scenarios(log_dir, world: int) -> list:
    """What :func:`run_scenarios` saved, per rank (an empty list for a rank that saved nothing)."""
    paths = [os.path.join(log_dir, f"rank{r}.pt") for r in range(world)]
    return [torch.load(p, weights_only=False) if os.path.exists(p) else [] for p in paths]


class Scenarios:
    """Per-rank evidence of a :func:`run_scenarios` launch, handed out case by case.

    ``get(t, k)`` inside the case of scenario ``k`` returns every rank's result;
    for the scenario where the launch failed it raises the launch's error there
    (so that case fails with it, a hang as a hang, NotImplementedError as "not
    attempted"), and later scenarios fail as not run.
    """

    def __init__(self, per_rank: list, error=None):
        self.per_rank, self.error, self.log_dir = per_rank, error, None
        self.complete = min((next((i for i, r in enumerate(rank) if r[0] != "ok"), len(rank))
                             for rank in per_rank), default=0)

    def get(self, t, k: int) -> list:
        if k < self.complete:
            return [rank[k][1] for rank in self.per_rank]
        if k == self.complete and self.error is not None:
            raise self.error
        t.fail("not run: an earlier scenario of this check failed (see above)", got="skipped")


def launch_scenarios(t, probe, world: int, answer, scenarios, timeout: float) -> Scenarios:
    """In the kernel: one launch of ``probe(answer, scenarios, log_dir)`` in ``world`` ranks.

    ``log_dir`` is made where the ranks run (a grader's sandbox) and read there.
    """
    from mgpu_lab.launcher.errors import LaunchError

    log_dir = t.scratch("mgpu-lab-scenarios-")
    try:
        evidence = Scenarios(t.ranks(probe, world, answer, scenarios, log_dir, timeout=timeout))
    except LaunchError as exc:
        evidence = Scenarios(t.local(read_scenarios, log_dir, world), exc)
    evidence.log_dir = log_dir  # what else the probe left there is read with t.local(helper, log_dir, ...)
    return evidence
