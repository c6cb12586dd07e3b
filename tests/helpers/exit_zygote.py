"""A zygote for exit_runs.py: imports torch and zero_ext once, then forks one child per request, and
the child runs a script as ``__main__`` and ends as that script's interpreter would (SystemExit,
an uncaught exception, or falling off the end, then Py_FinalizeEx with its atexit hooks): the same
teardown as a fresh ``python SCRIPT``, without paying torch's import (seconds on a loaded machine).

Protocol, one JSON line each way: {"script", "args", "env", "stderr"} in; {"pid"} then {"code"} out
(the child's exit code; negative for the signal that killed it).
"""
import json
import os
import sys

import torch  # noqa: F401 - preloaded for the children
import torch.distributed  # noqa: F401

import zero_ext  # noqa: F401


def _serve():
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)
    sys.exit(0)


def _become(request):
    """In the child: the script's stdio, environment and argv; then its code in a fresh __main__."""
    os.setsid()  # a session of its own, as torchrun starts each rank
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    os.environ.update(request["env"])
    script = request["script"]
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    main = sys.modules["__main__"].__dict__
    builtins = main["__builtins__"]
    main.clear()  # (the zygote's names go: the script sees only its own)
    main.update(__name__="__main__", __file__=script, __builtins__=builtins)
    with open(script) as f:
        return compile(f.read(), script, "exec"), main


if __name__ == "__main__":
    _code, _globals = _become(_serve())
    exec(_code, _globals)
