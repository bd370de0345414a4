"""The launch context read once: torchrun's variables, what is missing, the attempt number."""
import pytest

from rpcmp.errors import NetworkError
from rpcmp.launch.env import LaunchEnv
from rpcmp.launch.network import interfaces, is_loopback, select_interface


def test_torchruns_variables_are_read_once_into_one_object():
    env = LaunchEnv.read({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                          "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "3",
                          "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "True",
                          "TORCHELASTIC_RUN_ID": "x", "RPCMP_CONNECT_TIMEOUT": "5"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (2, 3, 0, 1)
    assert (env.node_rank, env.nodes, env.restart, env.under_torchrun) == (2, 3, 1, True)
    assert env.connect_timeout == 5.0 and env.missing == () and env.store_address == ("10.0.0.1", 29500)


def test_outside_torchrun_the_missing_variables_are_named_and_defaults_hold():
    env = LaunchEnv.read({"MASTER_ADDR": "127.0.0.1"})
    assert env.missing == ("RANK", "WORLD_SIZE", "MASTER_PORT")
    assert (env.nodes, env.restart, env.under_torchrun, env.connect_timeout, env.local_rank) == (1, 0, False, 60.0, None)
    assert env.store_address is None  # no port: nothing to reach


def test_an_interface_that_does_not_exist_is_named_with_the_ones_that_do():
    assert "lo" in interfaces() and is_loopback("127.0.0.1") and not is_loopback("10.1.2.3")
    with pytest.raises(NetworkError, match=r"'nope0' does not exist .*'lo'.*--iface"):
        select_interface("nope0")
