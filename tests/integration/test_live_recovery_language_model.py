"""A language model's lost owner replaced in place: its own file, the longest of the live-recovery runs (two
runs of a traced GPT-2, over four processes and over five), so that the suite's workers can take it beside the others."""
import random
import re
import signal

import pytest

from helpers import assert_close_f32, run_command
from rpcmp.core.checkpoint import load_checkpoint
from test_live_recovery import _command, _run_and_hit

pytestmark = pytest.mark.integration
STEPS = 24


@pytest.mark.timeout(300)
def test_a_language_model_s_first_stage_lost_with_its_tied_embedding_is_rebuilt_and_equals_an_uninterrupted_run(tmp_path):
    """Hugging Face GPT-2 built from its config, cut in 3 on the traced graph: stage 0 holds wte, which the last
    stage's lm_head shares (one parameter across two stages); its owner is SIGKILLed after the first snapshot."""
    lm = ["--epochs", "10"]  # 6 steps an epoch; 24 steps: the kill, then 9-13 steps after it
    # the run left alone: the master and three owners, no spare (one process fewer; a spare and its
    # snapshots change nothing of the math)
    clean = run_command(*_command(tmp_path / "clean", *lm, job="hf_gpt2", steps=STEPS, local=4), timeout=240)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    code, out = _run_and_hit(tmp_path / "run", [(random.randint(11, 15), "worker1", signal.SIGKILL)], "--spares", "1",
                             *lm, job="hf_gpt2", steps=STEPS)
    assert code == 0, out
    built = re.search(r"stages built in \d+\.\d s", out)  # progress while the master traces, then its figure
    assert built and 0 <= out.find("building the stages (tracing the model") < built.start(), out
    assert out.count("recovered: worker1 was lost") == 1 and "rebuilt on worker4 from the snapshot of step 10" in out, out
    got, want = load_checkpoint(str(tmp_path / "run")), load_checkpoint(str(tmp_path / "clean"))
    assert got["step"] == want["step"] == STEPS
    assert_close_f32(got["model"], want["model"])
