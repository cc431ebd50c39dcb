"""Course tooling: ``checks`` (the graded exercises: one package per lesson, ``lNN``, and ``sim``),
``assign`` (student notebooks generated from ``solutions/``; ``refresh``) and
``grade`` (batch grading of submitted notebooks, each in its own ``sandbox``:
``isolation`` says what this machine can isolate, ``sandbox_init`` closes a
sandbox, ``runner`` runs the notebook and the learner's code inside it,
``session`` runs the checkers outside it, ``gradescope`` writes Gradescope's
results; ``cells`` decides which demo cells grading skips, ``batch`` grades
many at once and keeps their grades, ``summary`` sums up a class).
"""
