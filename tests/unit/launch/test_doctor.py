import socket

from click.testing import CliRunner

from rpcmp.cli import main


def _run(*args):
    return CliRunner().invoke(main, ["doctor", *args], env={"COLUMNS": "200"})


def test_healthy_node_with_a_listening_master():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        result = _run("--master", f"127.0.0.1:{port}", "--iface", "lo")
    assert result.exit_code == 0, result.output
    assert f"127.0.0.1:{port} reachable" in result.output and "ready" in result.output
    assert "<- rpcmp" in result.output and "gloo" in result.output and "TensorPipe" in result.output


def test_broken_setup_lists_what_to_fix():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    result = _run("--master", f"127.0.0.1:{closed}", "--iface", "nope0", "--nodes", "3")
    assert result.exit_code == 1
    out = result.output
    assert "nope0: missing" in out and "use one of" in out
    assert f"127.0.0.1:{closed} unreachable" in out and "start the master first" in out
    assert "not ready" in out
