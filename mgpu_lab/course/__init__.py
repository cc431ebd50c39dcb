"""Course tooling: ``checks`` (the graded exercises, one module per lesson),
``assign`` (student notebooks generated from ``solutions/``; ``refresh``) and
``grade`` (batch grading of submitted notebooks).
"""
