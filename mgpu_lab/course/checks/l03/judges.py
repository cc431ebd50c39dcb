"""Lesson 03's verdicts: the evidence of :mod:`.ranks`, in the words of each case."""
from __future__ import annotations

from ..sim.outcome import in_words


FIRST = "not judged: your code did not finish the first case (see there)"


def need(t, evidence):
    if evidence is None:
        t.fail(FIRST, got="skipped")


# -- replicate ---------------------------------------------------------------------------
def replicas(t, runs, i):
    """The report of scenario ``i``, failing the case when the call raised or returned no list of modules."""
    need(t, runs)
    result = runs[i]
    if result[0] == "raised":
        hint = ""
        if "as parameter" in result[2]:
            hint = ("a module's registered parameters must be leaf nn.Parameters; a copy computed from the "
                    "model's parameter is not a leaf, so a replica cannot register it as a Parameter")
        t.fail(hint, "a list of replicas", in_words(result, raised="your code raised "))
    report = result[1]
    if report["type"] != "list":
        t.fail("replicate returns a list of modules, one per device", "a list of nn.Module", report["type"])
    return report


def misplaced(report) -> list[str]:
    """``replica i: parameter inp.weight on cuda:0`` for every tensor not on its replica's device."""
    devices = report["devices"]
    return [f"replica {i}: {kind} {name} on {on}" for i, kind, name, on in report["placement"]
            if i < len(devices) and on != devices[i]]


NO_GRAD = {
    "detached": "your replicas' parameters do not require gradients (detached, or made under no_grad): "
                "backward stops at them and the model's .grad stays None",
    "leaf": "your replicas' parameters are leaves of their own (new nn.Parameter objects, or a deep copy): "
            "autograd does not connect them to the model's parameters, so their gradients stay in the replicas",
}


def grad_words(report) -> tuple[str, str]:
    """(hint, what the model got) for a backward whose gradients did not sum into the model."""
    kinds = report.get("kinds", [])
    grads = report.get("grads")
    if grads == "missing":
        why = next((NO_GRAD[k] for k in ("detached", "leaf") if k in kinds), "no gradient reached the model")
        return why, "the model's .grad is None"
    if grads == "averaged":
        return ("the model got the mean of the replicas' gradients: replicate's backward adds them (the mean, "
                "if wanted, belongs to the loss)"), "the mean of the replicas' gradients"
    if grads == "first only":
        return ("only the gradient of replica 0 reached the model: the other replicas' parameters are cut off "
                "from it"), "replica 0's gradient only"
    return "", "gradients different from the sum of the replicas'"


# -- data_parallel_forward ------------------------------------------------------------------
def dp(t, runs, i):
    need(t, runs)
    result = runs[i]
    if result[0] == "raised":
        t.fail("", "the gathered output", in_words(result, raised="your code raised "))
    report = result[1]
    if report["type"] != "Tensor":
        t.fail("data_parallel_forward returns the gathered output tensor", "Tensor", report["type"])
    return report
