"""Shared fixtures: every test is seeded; no env var leaks; what child processes leave in
the temp directory (torchrun's torchelastic_* log folders) lands in pytest's own, which
pytest prunes, not in /tmp."""
import os
import tempfile

import pytest
import torch

import rpcmp.launch.server


@pytest.fixture(autouse=True, scope="session")
def _session_tmpdir(tmp_path_factory):
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # re-read TMPDIR in this process too
    yield
    if saved is None:
        os.environ.pop("TMPDIR")
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None


# Every model library a test job uses, and what tracing imports, imported once by the fork server local ranks start from.
rpcmp.launch.server.preload("segmentation_models_pytorch", "transformers.models.gpt2.modeling_gpt2",
                            "transformers.models.llama.modeling_llama", *rpcmp.launch.server.TRACING)


@pytest.fixture(autouse=True)
def _seed_and_env():
    torch.manual_seed(0)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# The files that take longest on one worker (seconds of tests beside a busy core, 2026-12-06): network
# namespaces 271, faults 259 (two runs stopped for over a minute), checkpoint resume 140.
FIRST = ("test_network.py", "test_faults.py", "test_checkpoint_resume.py")


def pytest_collection_modifyitems(items):
    """The longest files first (``FIRST``): the network-namespace one builds one cluster at a time on one
    worker, and any of them started late would be the run's tail. `make test` runs `--dist loadfile
    --no-loadscope-reorder`, so the workers take whole files in this order: those, the other files that
    launch processes (tests/integration), then the in-process ones, which fill the gaps at the end."""
    def rank(item) -> int:
        name = item.nodeid.split("::")[0].rsplit("/", 1)[-1]
        return FIRST.index(name) if name in FIRST else len(FIRST)
    items.sort(key=rank)
