"""Run a source tree's own rpcmp: the environment for a fresh interpreter (and every process it
starts) that imports ``rpcmp`` from ``tree``, not from the editable install of this checkout.

setuptools' editable install puts a finder on ``sys.meta_path``, after ``sys.path``: a module the
tree lacks (another layout) is then found in the checkout, and the two trees mix. A
``sitecustomize`` in a folder of its own, first on ``PYTHONPATH``, takes the finder off in every
process before anything imports rpcmp (spawned and forked ranks included).
"""
from __future__ import annotations

import os
import tempfile

_SITE = '''import sys
sys.meta_path[:] = [f for f in sys.meta_path if not str(getattr(f, "__module__", "")).startswith("__editable__")]
sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
'''


def tree_env(tree: str, modules: dict[str, str] | None = None) -> dict:
    """``modules``: more files (name -> source) for that folder, importable in every process."""
    folder = tempfile.mkdtemp(prefix="rpcmp-tree-")
    for name, source in {"sitecustomize.py": _SITE, **(modules or {})}.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(source)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([folder, os.path.abspath(tree)])}
