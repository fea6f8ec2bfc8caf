"""The layout's import rules (docs/architecture.md, "Map"), checked on the source so a drift fails here.

Each folder's docstring says what must not live or be imported there; these are the rules a reader
relies on when they open one folder without the others.
"""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {  # folder -> import name
    "src/pdcluster": "pdcluster",
}

# The one worker module the operator may import: the KV secret and the internal token derived from it,
# which both sides must compute identically (stdlib only; test_shared_secret_module_is_stdlib_only).
# Likewise the router may import the engine's block hash (stdlib only), so that its prefix-cache index
# names blocks exactly as the engine's prefix cache does.
# And the operator may import the engine's tensor-parallel head rule (stdlib only), so `kv-budget` and the
# engine's sharded cache cannot disagree on which KV heads a rank holds.
# And the operator reads the transfer's and the router's option declarations (stdlib only), so that the spec's
# defaults are the flags' (one default per knob: a rendered pod and a hand-run process agree).
# And the operator renders vLLM's connector config from the one declaration `up` uses too (stdlib only).
ALLOWED = {("pdcluster.operator", "pdcluster.worker.transfer.vllm_connector"),
           ("pdcluster.operator", "pdcluster.worker.transfer.secret"),
           ("pdcluster.worker.router", "pdcluster.worker.engine.block_hash"),
           ("pdcluster.operator", "pdcluster.worker.engine.parallel.heads"),
           ("pdcluster.operator", "pdcluster.worker.transfer.options"),
           ("pdcluster.operator", "pdcluster.worker.router.options")}
STDLIB_ONLY = ["src/pdcluster/worker/transfer/secret.py", "src/pdcluster/worker/engine/block_hash.py",
               "src/pdcluster/worker/engine/parallel/heads.py", "src/pdcluster/worker/options.py",
               "src/pdcluster/worker/transfer/options.py", "src/pdcluster/worker/router/options.py",
               "src/pdcluster/worker/transfer/vllm_connector.py"]

# (importer prefix, forbidden import prefixes)
RULES: list[tuple[str, tuple[str, ...]]] = [
    # the benchmarks (benchmarks/) and the tests live outside the wheel: nothing shipped may import them
    ("pdcluster", ("benchmarks", "tests")),
    ("pdcluster.operator", ("torch", "triton", "pdcluster.worker.engine.", "pdcluster.worker.server",
                            "pdcluster.worker.router", "pdcluster.worker.transfer", "pdcluster.kernels",
                            "pdcluster.bench")),
    ("pdcluster.worker", ("pdcluster.bench",)),
    ("pdcluster.kernels", ("pdcluster.bench", "pdcluster.worker", "pdcluster.operator")),
    ("pdcluster.worker.engine", ("pdcluster.worker.api", "pdcluster.worker.server", "pdcluster.worker.router",
                                 "pdcluster.worker.transfer", "pdcluster.worker.local", "fastapi", "uvicorn",
                                 "httpx", "pdcluster.operator")),
    ("pdcluster.worker.api", ("torch", "pdcluster.worker.server", "pdcluster.worker.router",
                              "pdcluster.worker.local")),
    ("pdcluster.worker.router", ("torch", "pdcluster.worker.engine", "pdcluster.worker.server",
                                 "pdcluster.worker.local", "pdcluster.kernels")),
    ("pdcluster.worker.server", ("pdcluster.worker.router", "pdcluster.worker.local")),
    ("pdcluster.worker.transfer", ("pdcluster.worker.server", "pdcluster.worker.router",
                                   "pdcluster.worker.api", "pdcluster.worker.local")),
    # the native CPU kernels are reached through pdcluster.kernels.native, their one entry and one switch
    ("pdcluster.worker", ("pdcluster.kernels.cpu",)),
    ("pdcluster.operator", ("pdcluster.kernels.cpu",)),
    ("pdcluster.bench", ("pdcluster.kernels.cpu",)),
]


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for folder, name in PACKAGES.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append((".".join([name, *parts]), path))
    return out


def _imports(path: pathlib.Path) -> list[tuple[int, str, int]]:
    """(line, imported module, relative level) for every import, including ones inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module or "", node.level))
            found += [(node.lineno, f"{node.module}.{a.name}", node.level) for a in node.names]
    return found


MODULES = _modules()


@pytest.mark.parametrize("module,path", MODULES, ids=[m for m, _ in MODULES])
def test_imports_follow_the_layout(module: str, path: pathlib.Path) -> None:
    bad = []
    for line, imported, level in _imports(path):
        if level:
            bad.append(f"{path.name}:{line} relative import (the tree uses absolute pdcluster.* imports)")
            continue
        for importer, forbidden in RULES:
            if any(imported.startswith(ok) and importer == who for who, ok in ALLOWED):
                continue
            if module == importer or module.startswith(importer + "."):
                hit = [f for f in forbidden if imported == f.rstrip(".") or imported.startswith(f.rstrip(".") + ".")]
                if hit:
                    bad.append(f"{path.name}:{line} imports {imported} (forbidden in {importer})")
    assert not bad, "\n".join(bad)


def test_no_sys_path_edits_in_shipped_code() -> None:
    offenders = [str(p.relative_to(ROOT)) for _, p in MODULES if "sys.path" in p.read_text()]
    assert not offenders, offenders


def test_every_folder_says_what_lives_there() -> None:
    missing = []
    for _, path in MODULES:
        if path.name == "__init__.py" and ast.get_docstring(ast.parse(path.read_text())) is None:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, missing


WARN_LINES, MAX_LINES = 400, 600  # a file holds one idea: past 400 lines look for a seam, past 600 split it


def test_files_are_sized_by_their_seams() -> None:
    sizes = {path.relative_to(ROOT): path.read_text().count("\n") for _, path in MODULES}
    for rel, n in sorted(sizes.items()):
        if WARN_LINES < n <= MAX_LINES:
            warnings.warn(f"{rel}: {n} lines (over {WARN_LINES}: is it still one idea?)", stacklevel=1)
    too_long = [f"{rel}: {n} lines" for rel, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not too_long, f"over {MAX_LINES} lines (split along a seam): {too_long}"


@pytest.mark.parametrize("rel", STDLIB_ONLY)
def test_modules_shared_across_the_layout_are_stdlib_only(rel: str) -> None:
    import sys

    path = ROOT / rel
    shared = [".".join(pathlib.Path(r).with_suffix("").parts[1:]) for r in STDLIB_ONLY]  # stdlib only too

    def ok(m: str) -> bool:  # stdlib, or another of these modules (a name in it, the package it comes from)
        return m.split(".")[0] in sys.stdlib_module_names or m.split(".")[0] == "__future__" or any(
            m == s or m.startswith(s + ".") or s.startswith(m + ".") for s in shared)

    third_party = [m for _, m, _ in _imports(path) if not ok(m)]
    assert not third_party, third_party
