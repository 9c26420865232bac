"""What many tests share, in one place: the host agent as a subprocess client (``support.agent``), one bounded
wait (``support.waiting``; ``support.pilot`` runs it under a Textual pilot) and what the kernel says about
processes and cgroups (``support.procfs``).

Importable from every test (pytest puts ``tests/`` on ``sys.path`` through ``tests/conftest.py``) and from the
scripts under ``tests/device`` and ``tests/bench``, which add ``tests/`` to ``sys.path`` themselves. Nothing here
needs pytest, so those scripts run where only the repository is.
"""
