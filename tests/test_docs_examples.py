"""Every runnable example in docs/ (a ```python block starting with `# example: NAME`) runs on 2 ranks."""
import os
import re

import pytest

from helpers import ROOT
from helpers.harness import run_ranks

DOCS = os.path.join(ROOT, "docs")


def _examples():
    found = []
    for name in sorted(os.listdir(DOCS)):
        if name.endswith(".md"):
            text = open(os.path.join(DOCS, name)).read()
            for code in re.findall(r"```python\n(# example: [^\n]+\n.*?)```", text, flags=re.S):
                found.append(pytest.param(code, id=f"{name}:{code.splitlines()[0].split(':', 1)[1].strip()}"))
    return found


def _run(code):
    exec(compile(code, "<docs example>", "exec"), {"__name__": "__docs_example__"})
    return True


@pytest.mark.parametrize("code", _examples())
def test_docs_example_runs_on_two_ranks(code):
    assert run_ranks(2, _run, code) == [True, True]


def test_the_debugging_page_has_its_examples():
    assert len([p for p in _examples() if "debugging.md" in p.id]) == 3


def test_the_zero3_guide_has_its_example():
    assert any("zero3-guide.md" in p.id for p in _examples())
