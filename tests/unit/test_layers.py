"""The layout is the design: imports go down the layers only, and every documented import
path works (the README, workers/, launch/, benchmarks/ and examples/ use these)."""
import ast
import importlib
import os
import pkgutil
import re

import pytest

import rpcmp

ROOT = os.path.dirname(rpcmp.__file__)
# Low to high. A module may import its own layer and the layers below it, never one above.
LAYERS = {"errors": 0, "core": 1, "plan": 2, "job": 3, "data": 3, "owner": 4, "master": 5, "train": 6, "launch": 6, "cli": 7}


def _modules():
    for info in pkgutil.walk_packages(rpcmp.__path__, "rpcmp."):
        yield info.name


def _layer(name: str) -> int | None:
    part = name.split(".")[1] if name.count(".") else None
    return LAYERS.get(part)


def _imports(name: str):
    """The rpcmp modules ``name`` imports, at module level or inside functions."""
    path = importlib.util.find_spec(name).origin
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else node.module
            if base and base.split(".")[0] == "rpcmp":
                yield from ([base] if node.module else [f"{base}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "rpcmp")


def test_imports_go_down_the_layers_only():
    up = []
    for name in _modules():
        own = _layer(name)
        if own is None or name.endswith("__main__"):  # entry points sit above every layer
            continue
        for target in _imports(name):
            theirs = _layer(target)
            if theirs is not None and theirs > own:
                up.append(f"{name} (layer {own}) imports {target} (layer {theirs})")
    assert not up, "\n".join(up)


def test_every_module_belongs_to_a_layer():
    assert [n for n in _modules() if _layer(n) is None and n.count(".") == 1] == []


@pytest.mark.parametrize("path", sorted(_modules()))
def test_every_module_imports(path):
    if not path.endswith("__main__"):
        importlib.import_module(path)


def test_the_documented_names_import():
    from rpcmp import Job, Pipeline, Split, SplitAt, load_job  # noqa: F401
    from rpcmp.cli import console, main  # noqa: F401  (the `rpcmp` console script, its click group)
    assert importlib.util.find_spec("rpcmp.master.__main__") is not None  # python -m rpcmp.master
    assert importlib.util.find_spec("rpcmp.cli.__main__") is not None  # python -m rpcmp.cli (launch/*.sh)
    for name in rpcmp.__all__:
        assert getattr(rpcmp, name) is not None


# Old module paths that benchmarks/ab_trees.py and benchmarks/startup.py import on purpose, from
# trees of earlier commits (each behind an ImportError fallback).
_OLD_TREES = {"rpcmp.local", "rpcmp.runtime", "rpcmp.replicas"}


def _documented_paths():
    repo = os.path.dirname(ROOT)
    files = ["README.md", "Makefile", "setup.cfg"]
    for folder in ("workers", "launch", "benchmarks", "examples"):
        for base, dirs, names in os.walk(os.path.join(repo, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]  # compiled modules (make bytecode), not text
            files += [os.path.relpath(os.path.join(base, n), repo) for n in names]
    for rel in files:
        text = open(os.path.join(repo, rel), errors="replace").read()
        for dotted in set(re.findall(r"(?<![\w./])rpcmp(?:\.[A-Za-z_]\w*)+", text)):
            yield rel, dotted


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return importlib.util.find_spec(".".join(parts[:cut]) + ".__main__") is not None and not parts[cut:]
            obj = getattr(obj, attr)
        return True
    return False


def test_every_rpcmp_path_the_docs_scripts_and_benchmarks_name_exists():
    missing = [f"{rel}: {dotted}" for rel, dotted in _documented_paths()
               if dotted not in _OLD_TREES and not _resolves(dotted)]
    assert not missing, "\n".join(missing)
