"""tests/jobs/three.py with tests/jobs/paced_slow_keep.py's slow keep of a snapshot (its environment says where)."""
import paced_slow_keep  # noqa: F401 - patches rpcmp.owner.snapshot.keep
from three import job  # noqa: F401
