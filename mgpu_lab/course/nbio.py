"""``nbformat`` without the import cost of an IRI checker that notebooks never use.

``nbformat`` imports ``jsonschema``, and ``jsonschema`` imports ``rfc3987_syntax``
when it is installed (it comes with Jupyter Server's ``jsonschema[format-nongpl]``)
to check the ``iri`` string format. That import builds a Lark grammar: 1.8 s of
CPU here, in every process that reads a notebook, which is every notebook the
grader runs. The notebook schemas use no string format at all, and ``nbformat``
validates with ``fastjsonschema``; so :func:`nbformat` imports it with that one
optional module hidden, and ``jsonschema`` goes without its ``iri`` checks.

Example:
    >>> from pathlib import Path
    >>> nb = nbformat().read(Path(__file__).parents[2] / "solutions" / "01_devices.ipynb", as_version=4)
    >>> nb.nbformat, nb.cells[0].cell_type
    (4, 'markdown')
"""
from __future__ import annotations

import sys
import types

_SLOW = "rfc3987_syntax"


def nbformat() -> types.ModuleType:
    """The ``nbformat`` module, imported without ``rfc3987_syntax`` if nothing imported it before."""
    if "nbformat" not in sys.modules and _SLOW not in sys.modules:
        sys.modules[_SLOW] = None  # `import rfc3987_syntax` raises ImportError; jsonschema expects that
        try:
            import nbformat  # noqa: F401
        finally:
            if sys.modules.get(_SLOW, 0) is None:
                del sys.modules[_SLOW]  # whoever imports it later gets the real module
    import nbformat

    return nbformat
