"""A job file that imports in the launching process but fails in every child process
(a module only the launching machine has, a path relative to its working directory)."""
import multiprocessing

if multiprocessing.parent_process() is not None:
    raise ImportError("no module named 'only_on_the_laptop' (raised in a child on purpose)")

from mlp import job  # noqa: E402,F401
