"""The built-in demo model is the same on every interpreter: its tokenizer's training text ships with the
package. Before, it was read from the running Python's standard library, and the worker image (Debian's
python3.11 3.11.2) trained another vocabulary than this venv (3.11.7): equal token ids decoded to different
text in the real-node e2e."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from pdcluster.worker.local import demo_model


@pytest.fixture
def other_stdlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An interpreter whose stdlib holds other text in the modules the corpus used to read (a patch release)."""
    real = Path(sysconfig.get_paths()["stdlib"])
    fake = tmp_path / "lib"
    for name in ("argparse.py", "calendar.py", "textwrap.py", "difflib.py"):
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        text = (real / name).read_text(encoding="utf-8") if (real / name).is_file() else ""
        (fake / name).write_text(text.replace("def ", "def patched_release_") + "\n# 3.11.2\n" * 400)
    paths = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**paths(*a, **k), "stdlib": str(fake)})
    return fake


def test_tokenizer_does_not_depend_on_the_interpreters_stdlib(other_stdlib: Path, monkeypatch: pytest.MonkeyPatch):
    changed = demo_model.build_tokenizer(300).to_str()
    monkeypatch.undo()
    assert demo_model.build_tokenizer(300).to_str() == changed


def test_packaged_corpus_is_the_twelve_modules():
    texts = demo_model._corpus()
    python = [t for t in texts if "def " in t]
    assert len(python) == 12, len(python)
    assert any("class ArgumentParser(" in t for t in python)  # argparse.py, one that differs across 3.11.x
    assert sum(map(len, python)) > 300_000
