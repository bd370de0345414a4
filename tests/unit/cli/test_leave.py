"""The command line's end without the interpreter's teardown (rpcmp/cli/leave.py): it says, runs and
returns all that the interpreter's exit would, in a real process."""
import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import atexit, sys, time
    from concurrent.futures import ThreadPoolExecutor
    import click
    from rpcmp.cli.leave import program

    @click.command()
    @click.argument("how")
    @click.argument("stem")
    def command(how, stem):
        atexit.register(lambda: open(stem + ".atexit", "w").close())
        pool = ThreadPoolExecutor(1)  # left running: the interpreter's exit waits for its work
        pool.submit(lambda: (time.sleep(0.3), open(stem + ".pool", "w").close()))
        sys.stdout.write("no newline, a buffered pipe")
        if how == "raise":
            raise KeyError("the command's own error")
        sys.exit({"zero": 0, "three": 3, "words": "a message for the exit"}[how])

    program(command)
""")


@pytest.mark.parametrize("how,code", [("zero", 0), ("three", 3), ("words", 1), ("raise", 1)])
def test_a_command_line_ends_with_its_code_its_output_its_exit_hooks_and_its_threads_work_done(tmp_path, how, code):
    stem = str(tmp_path / "mark")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout a buffered pipe
    done = subprocess.run([sys.executable, "-c", PROGRAM, how, stem], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == code, done.stderr
    assert done.stdout == "no newline, a buffered pipe"
    assert (tmp_path / "mark.atexit").exists() and (tmp_path / "mark.pool").exists()
    if how == "words":
        assert done.stderr.strip() == "a message for the exit"
    if how == "raise":
        assert "KeyError: \"the command's own error\"" in done.stderr and "Traceback" in done.stderr
