"""``python -m mgpu_lab``: the same as the ``mgpu-lab`` command."""

from mgpu_lab.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
