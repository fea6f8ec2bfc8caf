"""Build-once loader for the C++ CPU kernels in this folder.

Why JIT and not a wheel-time build: the project installs as plain Python (uv, editable) and the kernels use
AVX-512, which only the machine that runs them can vouch for. A module is compiled the first time a process
asks for it, into a cache folder keyed by everything that changes the binary (sources, flags, torch and
Python versions), so the next process loads it in milliseconds — without ninja or a compiler once a build
has finished there (a cache folder filled elsewhere serves too). Nothing here is required: every failure
(no compiler, no ninja, a CPU without AVX-512, a compile error) logs one line saying why and returns None,
and the caller runs its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger("pdcluster.kernels.cpu")

HERE = Path(__file__).resolve().parent
# The one switch: unset or "1" every native kernel, "0" none (nothing is built or loaded), "-name[,-name...]"
# every kernel but those named (an A/B of one kernel served beside the others). Read at each call.
ENV_SWITCH = "PDCLUSTER_NATIVE_KERNELS"
KERNELS = ("argmax", "attention", "decoder", "linear", "norm", "quant", "rope", "screen")
PREBUILT_ENV = "PDCLUSTER_NATIVE_PREBUILT"  # a folder of builds made elsewhere (an image), see prebuilt_root
CFLAGS = ["-O3", "-march=x86-64-v4", "-mtune=native", "-fopenmp", "-ffp-contract=fast"]
LDFLAGS = ["-fopenmp"]
BUILT_MARKER = "built"  # written after a build loaded; see _built

_lock = threading.Lock()
_modules: dict[str, ModuleType | None] = {}


def outcomes() -> dict[str, bool]:
    """Every module this process asked for -> whether it runs natively (False: its torch path). Read by the
    worker's /metrics (`pdcluster_native_kernel_loaded`), so a pod silently on the torch path can be alerted on."""
    with _lock:
        return {name: mod is not None for name, mod in _modules.items()}


@functools.lru_cache(maxsize=16)
def _turned_off(raw: str) -> frozenset[str]:
    """The kernels a value of the switch turns off (every one for "0"); ValueError naming the switch for a
    value it does not take."""
    value = raw.strip()
    if value in ("", "1"):
        return frozenset()
    if value == "0":
        return frozenset(KERNELS)
    names = [part.strip() for part in value.split(",")]
    bad = [n for n in names if not n.startswith("-") or n[1:] not in KERNELS]
    if bad:
        raise ValueError(f"{ENV_SWITCH}={raw!r}: expected 1, 0 or -kernel[,-kernel...] with kernels from "
                         f"{', '.join(KERNELS)}")
    return frozenset(n[1:] for n in names)


def switched_off() -> bool:
    """The switch turns every kernel off ("0"): none is built or loaded in this process from now on. Raises
    ValueError for a value the switch does not take (the first load, at start-up, reports it)."""
    return _turned_off(os.environ.get(ENV_SWITCH, "1")) == frozenset(KERNELS)


def enabled(kernel: str) -> bool:
    """Whether the switch lets ``kernel`` (one of KERNELS) run now (read at each call, so a test or a benchmark
    can flip it); whether it can run here is the loader's business (None from ``load``)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown native kernel {kernel!r} (one of {', '.join(KERNELS)})")
    return kernel not in _turned_off(os.environ.get(ENV_SWITCH, "1"))


@functools.cache
def cpu_flags() -> set[str]:
    """The `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def unrunnable_reason() -> str | None:
    """Why no native kernel can run here (switched off, another platform, no AVX-512), or None."""
    if switched_off():
        return f"{ENV_SWITCH}={os.environ.get(ENV_SWITCH)}"
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 Linux ({sys.platform}/{platform.machine()})"
    missing = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} - cpu_flags()
    if missing:
        return "the CPU lacks " + ", ".join(sorted(missing))
    return None


def unavailable_reason() -> str | None:
    """Why no native kernel can be built or run here, or None when they can."""
    reason = unrunnable_reason()
    if reason is not None:
        return reason
    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        return "no C++ compiler on PATH"
    if not shutil.which("ninja"):
        return "ninja is not on PATH"
    return None


def cache_root() -> Path:
    base = os.environ.get("PDCLUSTER_CACHE") or str(Path.home() / ".cache" / "pdcluster")
    return Path(base) / "native-kernels"


def prebuilt_root() -> Path | None:
    """A read-only folder of finished builds looked in before the cache (`$PDCLUSTER_NATIVE_PREBUILT`): the
    worker image's, filled when it was built (docker/worker.Dockerfile), so pods with a read-only root and
    no compiler still run the native kernels."""
    folder = os.environ.get(PREBUILT_ENV, "")
    return Path(folder) if folder else None


def build_key(name: str, sources: list[Path], headers: tuple[Path, ...] = ()) -> str:
    import torch

    h = hashlib.sha256()
    for part in (name, torch.__version__, sys.version, " ".join(CFLAGS + LDFLAGS)):
        h.update(part.encode() + b"\0")
    for src in [*sources, *headers]:
        h.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def load(name: str, sources: list[str], headers: tuple[str, ...] = ()) -> ModuleType | None:
    """The compiled module `name` built from `sources` (file names in this folder) and the `headers` they
    include, or None (logged once)."""
    with _lock:
        if name in _modules:
            return _modules[name]
        _modules[name] = mod = _build(name, [HERE / s for s in sources], tuple(HERE / h for h in headers))
        return mod


def _built(name: str, key: str, folder: Path) -> ModuleType | None:
    """The module a finished build left in `folder` (its marker written after a successful load), imported
    without ninja or a compiler: a cache another process filled (a shared volume, an image) serves a machine
    that cannot build. The key already covers sources, flags, torch and Python (computing it imported torch,
    whose libraries the module links against)."""
    marker = folder / BUILT_MARKER
    if not marker.is_file():
        return None
    lib = folder / Path(marker.read_text().strip()).name  # torch names a rebuild in one process name_v1.so
    if lib.suffix != ".so" or not lib.is_file():
        return None
    spec = importlib.util.spec_from_file_location(lib.name.split(".")[0], lib)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(name: str, sources: list[Path], headers: tuple[Path, ...]) -> ModuleType | None:
    reason = unrunnable_reason()
    if reason is not None:
        log.info("native CPU kernel %s off: %s; using the torch path", name, reason)
        return None
    key = build_key(name, sources, headers)
    folder = cache_root() / f"{name}-{key}"
    prebuilt = prebuilt_root()
    places = [(folder, "cached build")]
    if prebuilt is not None:
        places.insert(0, (prebuilt / folder.name, "prebuilt"))
    for where, kind in places:
        try:
            mod = _built(name, key, where)
        except Exception as exc:  # a damaged entry: the next place, else rebuild below if this machine can
            log.warning("native CPU kernel %s: the build in %s did not load (%s)", name, where, exc)
            mod = None
        if mod is not None:
            log.info("native CPU kernel %s loaded from %s (%s)", name, where, kind)
            return mod
    if prebuilt is not None:  # an image whose kernels were built from other sources or another torch
        log.info("native CPU kernel %s: no build %s-%s in %s", name, name, key, prebuilt)
    reason = unavailable_reason()
    if reason is not None:
        log.info("native CPU kernel %s off: %s; using the torch path", name, reason)
        return None
    try:
        from torch.utils.cpp_extension import load as cpp_load

        folder.mkdir(parents=True, exist_ok=True)
        for header in headers:  # beside the copied sources, where their #include "..." looks
            _stable_copy(header, folder)
        sources = [_stable_copy(src, folder) for src in sources]
        # copies: cpp_extension appends its own flags to the lists it is given
        mod = cpp_load(name=f"{name}_{key}", sources=[str(s) for s in sources], extra_cflags=list(CFLAGS),
                       extra_ldflags=list(LDFLAGS), build_directory=str(folder), verbose=False)
        marker = folder / f"{BUILT_MARKER}.{os.getpid()}.tmp"
        marker.write_text(Path(str(mod.__file__)).name + "\n")
        os.replace(marker, folder / BUILT_MARKER)  # only now may another process import the .so as it is
    except Exception as exc:  # a failed build must never take the worker down: it has a torch path
        log.warning("native CPU kernel %s could not be built (%s: %s); using the torch path",
                    name, type(exc).__name__, str(exc).strip().splitlines()[-1:] or "")
        return None
    log.info("native CPU kernel %s loaded from %s", name, folder)
    return mod


def _stable_copy(src: Path, folder: Path) -> Path:
    """The source as a file inside the build folder: ninja keys its build on the source's path and mtime, so
    building from each checkout's own path (a CI clone, a worktree) would recompile the same key every time
    another checkout had built it. The copy is rewritten only when its bytes differ."""
    dst = folder / "src" / src.name
    data = src.read_bytes()
    if not dst.exists() or dst.read_bytes() != data:
        dst.parent.mkdir(exist_ok=True)
        tmp = dst.with_suffix(dst.suffix + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    return dst
