"""tests/jobs/replicated_dies.py whose worker3 (replica 0's stage 1) waits in its build of the stages, as in
tests/jobs/three_slow_build.py."""
import dataclasses

from replicated_dies import job as replicated
from three_slow_build import waiting

job = dataclasses.replace(replicated, model=waiting(replicated.model, "worker3"))
