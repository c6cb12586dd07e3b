"""``deepspeed.launcher.runner``: zero_ext's one-node launcher (zero_ext/launcher.py).

``DEEPSPEED_ENVIRONMENT_NAME`` is the file DeepSpeed's multi-node launcher reads exported variables from;
accelerate imports the name. zero_ext has no multi-node launcher of its own: use torchrun (README).
"""
import sys

from zero_ext.launcher import main as _main

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"


def main(args=None):
    return _main(sys.argv[1:] if args is None else args)
