"""docs/config.md is generated from the schema; these tests fail when the two drift apart."""

import pathlib
import subprocess
import sys

import pytest

from zero_ext.config import UNIMPLEMENTED, DeepSpeedConfig
from zero_ext.config.base import alias_map, submodel_of
from zero_ext.config.deviations import DEVIATIONS
from zero_ext.config.docgen import main, render

REPO = pathlib.Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "config.md"
TEXT = render()


def _all_keys(model, path=""):
    for name, info in model.model_fields.items():
        here = f"{path}.{name}" if path else name
        yield model, name, here
        sub = submodel_of(info.annotation)
        if sub is not None and sub.model_config.get("extra") != "allow":
            yield from _all_keys(sub, here)


def test_docs_match_the_schema():
    assert DOC.read_text(encoding="utf-8") == TEXT, (
        "docs/config.md is stale: run `python -m zero_ext.config.docgen > docs/config.md`")


@pytest.mark.parametrize("model, name, path", list(_all_keys(DeepSpeedConfig)),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_key_and_alias_is_documented(model, name, path):
    text = TEXT
    section = path.rsplit(".", 1)[0] if "." in path else None
    assert f"| `{name}`" in text
    if section:
        assert f"## `{section}`" in text
    for alias, target in alias_map(model).items():
        if target == name:
            assert f"alias `{alias}`" in text


def test_unimplemented_table_and_deviations_are_documented():
    text = TEXT
    assert all(f"| `{path}` |" in text for path in UNIMPLEMENTED)
    assert all(topic in text for topic, *_ in DEVIATIONS)
    assert "Defaults follow DeepSpeed's current code (0.19.x)" in text


def test_check_mode_detects_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("5e7", "5e8"))
    assert main(["--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    stale.write_text(render())
    assert main(["--check", str(stale)]) == 0


def test_docgen_runs_as_a_module():
    out = subprocess.run([sys.executable, "-m", "zero_ext.config.docgen", "--check", str(DOC)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
