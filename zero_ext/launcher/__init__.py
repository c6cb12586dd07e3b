"""zero_ext.launcher: ``zero-ext`` / ``python -m zero_ext.launcher``, DeepSpeed's one-node launcher.

Files:
- runner.py: the launcher (processes, their environment, ``--local_rank``).
- estimate.py: ``zero-ext estimate``, the memory estimators' tables and ``--plot``.
- __main__.py: ``python -m zero_ext.launcher``.
"""
from .runner import main  # noqa: F401  (the console script zero_ext.launcher:main)
