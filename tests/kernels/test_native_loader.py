"""The native-kernel loader: builds once into the cache, and falls back (None, logged) on every failure."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdcluster.kernels.cpu import native
from tests.native_marks import needs_native

# narrow headers, as the real kernels use: <torch/extension.h> costs minutes of compile on this box
SRC = """
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>
at::Tensor twice(const at::Tensor& x) { return x.mul(2); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("PDCLUSTER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_modules", {})
    return tmp_path




@needs_native
def test_builds_once_into_the_cache_keyed_by_source(fresh: Path):
    src = fresh / "twice.cpp"
    src.write_text(SRC)
    mod = native.load("pdc_test_twice", [str(src)])
    assert mod is not None
    assert torch.equal(mod.twice(torch.arange(4.0)), torch.arange(4.0) * 2)
    assert native.load("pdc_test_twice", [str(src)]) is mod  # same process: no rebuild
    folders = list((fresh / "cache" / "native-kernels").iterdir())
    assert [f.name.split("-")[0] for f in folders] == ["pdc_test_twice"]
    assert folders[0].name == "pdc_test_twice-" + native.build_key("pdc_test_twice", [src]), folders
    src.write_text(SRC + "\n// changed\n")
    assert native.build_key("pdc_test_twice", [src]) not in folders[0].name


@needs_native
def test_a_finished_build_loads_without_a_compiler(fresh: Path, monkeypatch, caplog):
    """A cache filled elsewhere (a shared volume, an image) serves a machine with no compiler or ninja; a
    folder without the marker a finished build writes (a build that died mid-link) is never imported."""
    src = fresh / "twice.cpp"
    src.write_text(SRC)
    assert native.load("pdc_test_twice", [str(src)]) is not None
    (folder,) = (fresh / "cache" / "native-kernels").iterdir()
    assert (folder / native.BUILT_MARKER).is_file(), sorted(p.name for p in folder.iterdir())
    assert (folder / (folder / native.BUILT_MARKER).read_text().strip()).is_file()
    monkeypatch.setattr(native.shutil, "which", lambda *_: None)  # no c++, no g++, no ninja
    assert "compiler" in (native.unavailable_reason() or "")
    monkeypatch.setattr(native, "_modules", {})
    with caplog.at_level(logging.INFO, logger="pdcluster.kernels.cpu"):
        mod = native.load("pdc_test_twice", [str(src)])
    assert mod is not None and "cached build" in caplog.text
    assert torch.equal(mod.twice(torch.arange(3.0)), torch.tensor([0.0, 2.0, 4.0]))
    (folder / native.BUILT_MARKER).unlink()
    monkeypatch.setattr(native, "_modules", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdcluster.kernels.cpu"):
        assert native.load("pdc_test_twice", [str(src)]) is None
    assert "no C++ compiler" in caplog.text


@needs_native
def test_a_prebuilt_folder_is_looked_in_first(fresh: Path, monkeypatch, caplog):
    """The worker image's case: builds made at image build time in a read-only folder
    ($PDCLUSTER_NATIVE_PREBUILT) load with no compiler and an empty cache; a folder without this key's build
    (other sources, another torch) is reported and the cache and a build are tried as before."""
    src = fresh / "twice.cpp"
    src.write_text(SRC)
    assert native.load("pdc_test_twice", [str(src)]) is not None
    (fresh / "cache").rename(fresh / "image")  # the image's folder; the pod's own cache is empty
    monkeypatch.setenv(native.PREBUILT_ENV, str(fresh / "image" / "native-kernels"))
    monkeypatch.setattr(native.shutil, "which", lambda *_: None)
    monkeypatch.setattr(native, "_modules", {})
    with caplog.at_level(logging.INFO, logger="pdcluster.kernels.cpu"):
        mod = native.load("pdc_test_twice", [str(src)])
    assert mod is not None and "(prebuilt)" in caplog.text, caplog.text
    assert torch.equal(mod.twice(torch.arange(2.0)), torch.tensor([0.0, 2.0]))
    assert not (fresh / "cache").exists()  # nothing written outside the prebuilt folder
    src.write_text(SRC + "\n// another version\n")
    monkeypatch.setattr(native, "_modules", {})
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pdcluster.kernels.cpu"):
        assert native.load("pdc_test_twice", [str(src)]) is None
    assert "no build pdc_test_twice-" in caplog.text and "no C++ compiler" in caplog.text, caplog.text


@needs_native
def test_a_damaged_prebuilt_module_is_reported_and_the_cache_serves(fresh: Path, monkeypatch, caplog):
    """A prebuilt folder whose module does not load (truncated, another platform's) is a warning, not a
    crash: the cache (or a build) serves as if the folder were not there."""
    src = fresh / "twice.cpp"
    src.write_text(SRC)
    assert native.load("pdc_test_twice", [str(src)]) is not None
    (folder,) = (fresh / "cache" / "native-kernels").iterdir()
    image = fresh / "image" / folder.name
    image.mkdir(parents=True)
    lib = (folder / native.BUILT_MARKER).read_text().strip()
    (image / native.BUILT_MARKER).write_text(lib + "\n")
    (image / lib).write_bytes(b"\x7fELF truncated")
    monkeypatch.setenv(native.PREBUILT_ENV, str(fresh / "image"))
    monkeypatch.setattr(native, "_modules", {})
    with caplog.at_level(logging.INFO, logger="pdcluster.kernels.cpu"):
        mod = native.load("pdc_test_twice", [str(src)])
    assert mod is not None and torch.equal(mod.twice(torch.ones(2)), torch.full((2,), 2.0))
    assert f"the build in {image} did not load" in caplog.text and "(cached build)" in caplog.text, caplog.text


def test_prebuild_command_strict_fails_only_when_a_runnable_kernel_did_not_build(monkeypatch, capsys):
    from pdcluster.kernels.cpu import __main__ as prebuild

    monkeypatch.setattr(prebuild.native, "unrunnable_reason", lambda: None)
    monkeypatch.setattr(prebuild.step, "module", lambda: None)
    monkeypatch.setattr(prebuild.quant, "module", lambda: object())
    assert prebuild.main([]) == 0  # make setup: reported, never failed
    assert prebuild.main(["--strict"]) == 1  # an image build: fails
    assert "decode step (linear + attention): not built" in capsys.readouterr().out
    monkeypatch.setattr(prebuild.native, "unrunnable_reason", lambda: "the CPU lacks avx512f")
    assert prebuild.main(["--strict"]) == 0  # a build host that cannot run them: said, not failed
    assert "off (the CPU lacks avx512f)" in capsys.readouterr().out


def test_switched_off_by_env(fresh: Path, monkeypatch, caplog):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    with caplog.at_level(logging.INFO, logger="pdcluster.kernels.cpu"):
        assert native.load("pdc_test_off", ["does-not-matter.cpp"]) is None
    assert f"{native.ENV_SWITCH}=0" in caplog.text
    assert not any(native.enabled(k) for k in native.KERNELS)


@pytest.mark.parametrize(("value", "off"), [("", set()), ("1", set()), ("0", set(native.KERNELS)),
                                            ("-attention", {"attention"}), ("-linear, -screen", {"linear", "screen"})])
def test_the_one_switch_names_what_is_off(monkeypatch, value: str, off: set[str]):
    monkeypatch.setenv(native.ENV_SWITCH, value)
    assert {k for k in native.KERNELS if not native.enabled(k)} == off
    assert native.switched_off() == (off == set(native.KERNELS))  # only "0" keeps every build from loading


@pytest.mark.parametrize("value", ["off", "attention", "-gpu", "-linear,", "true"])
def test_a_value_the_switch_does_not_take_is_refused(monkeypatch, value: str):
    monkeypatch.setenv(native.ENV_SWITCH, value)
    with pytest.raises(ValueError, match=native.ENV_SWITCH):
        native.enabled("linear")
    with pytest.raises(ValueError, match=native.ENV_SWITCH):
        native.unrunnable_reason()
    with pytest.raises(ValueError, match="unknown native kernel"):
        native.enabled("gpu")


def test_no_avx512_means_torch_path(fresh: Path, monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma"})
    assert "avx512" in (native.unavailable_reason() or "")
    assert native.load("pdc_test_noavx", ["x.cpp"]) is None
    assert native.outcomes() == {"pdc_test_noavx": False}  # what /metrics reports as 0


@needs_native
def test_compile_error_is_logged_not_raised(fresh: Path, caplog):
    src = fresh / "broken.cpp"
    src.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="pdcluster.kernels.cpu"):
        assert native.load("pdc_test_broken", [str(src)]) is None
    assert "could not be built" in caplog.text and "torch path" in caplog.text


def test_sources_are_built_from_a_stable_copy(tmp_path: Path):
    """Two checkouts with the same source bytes build from one path inside the cache folder, so ninja does not
    recompile because the path changed; the copy is rewritten only when the bytes differ."""
    folder = tmp_path / "build"
    folder.mkdir()
    a, b = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for p in (a, b):
        p.parent.mkdir()
        p.write_text("int f() { return 1; }\n")
    first = native._stable_copy(a, folder)
    stamp = first.stat().st_mtime_ns
    assert native._stable_copy(b, folder) == first and first.stat().st_mtime_ns == stamp
    b.write_text("int f() { return 2; }\n")
    assert native._stable_copy(b, folder).read_text() == "int f() { return 2; }\n"
