"""Shared fixtures: every test is seeded; no env var leaks."""
import os

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_env():
    torch.manual_seed(0)
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
