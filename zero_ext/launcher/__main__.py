"""``python -m zero_ext.launcher``."""
import sys

from .runner import main

sys.exit(main())
