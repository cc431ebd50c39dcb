"""Run a pickled function in a torchrun worker: ``torchrun ... torchrun_worker.py PAYLOAD OUT_DIR``.

:func:`mgpu_lab.launcher.elastic.call` writes ``(fn, args, kwargs)`` with cloudpickle to
PAYLOAD; every worker initialises the process group from the variables
torchrun set, runs ``fn`` and writes its return value to ``OUT_DIR/rank<R>.pkl``
(atomically: a worker killed while writing leaves no half file).
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str] | None = None) -> None:
    import cloudpickle

    from mgpu_lab import dist as mdist

    payload, out_dir = (sys.argv[1:] if argv is None else argv)[:2]
    with open(payload, "rb") as f:
        fn, args, kwargs = cloudpickle.load(f)
    mdist.setup()
    value = fn(*args, **kwargs)
    path = os.path.join(out_dir, f"rank{mdist.rank()}.pkl")
    with open(path + ".tmp", "wb") as f:
        cloudpickle.dump(value, f)
    os.replace(path + ".tmp", path)
    mdist.teardown()


if __name__ == "__main__":
    main()
