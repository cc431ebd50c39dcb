"""Course tooling: ``checks`` (the graded exercises, one module per lesson),
``assign`` (student notebooks generated from ``solutions/``; ``refresh``) and
``grade`` (batch grading of submitted notebooks, each in its own ``sandbox``:
``sandbox_init`` closes it, ``runner`` runs the notebook and the learner's code
inside it, ``judge`` runs the checkers outside it, ``gradescope`` writes
Gradescope's results).
"""
