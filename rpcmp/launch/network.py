"""Network selection and the checks that turn a would-be hang into a clear error.

``--iface NAME`` (or ``RPCMP_IFACE``) names the interface every process talks on;
rpcmp sets both ``TP_SOCKET_IFNAME`` (TensorPipe) and ``GLOO_SOCKET_IFNAME`` from it.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import time

from ..errors import NetworkError

__all__ = ["NetworkError", "select_interface", "preflight", "interfaces", "is_loopback", "wait_reachable", "port_free", "bound_store",
          ]


def interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def select_interface(name: str | None = None) -> str | None:
    """Use interface ``name`` (default ``$RPCMP_IFACE``) for TensorPipe and gloo."""
    name = name or os.environ.get("RPCMP_IFACE")
    if not name:
        return None
    if name not in interfaces():
        raise NetworkError(f"network interface {name!r} does not exist on {socket.gethostname()}; "
                           f"it has {interfaces()}: pass one of them to --iface (or RPCMP_IFACE)")
    os.environ["TP_SOCKET_IFNAME"] = name
    os.environ["GLOO_SOCKET_IFNAME"] = name
    return name


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def wait_reachable(host: str, port: int, timeout: float) -> float:
    """Wait until ``host:port`` accepts a TCP connection; return the seconds waited."""
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return time.monotonic() - start
        except OSError as exc:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise NetworkError(
                    f"the master at {host}:{port} is unreachable: waited {waited:.0f}s ({exc}). Check that the "
                    f"master is running, that {host} is its address on a network this node shares, and that "
                    f"no firewall blocks port {port}; `rpcmp doctor --master {host}:{port}` shows what this node sees"
                ) from None
            time.sleep(0.5)


def port_free(host: str, port: int) -> None:
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the stores do: TIME_WAIT is no conflict
            s.bind((host, port))
    except OSError as exc:
        raise NetworkError(f"port {port} on {host} is in use ({exc.strerror}): another job or an old master still "
                           f"holds it. Pick another MASTER_PORT, or stop that process (`ss -ltnp | grep {port}`)") from None


def preflight(rank: int, nodes: int, connect_timeout: float | None = None) -> None:
    """Checks before joining: interface, a master address other nodes can reach, reachability."""
    select_interface()
    if connect_timeout is None:
        connect_timeout = float(os.environ.get("RPCMP_CONNECT_TIMEOUT", "60"))
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return
    if nodes > 1 and is_loopback(addr):
        raise NetworkError(
            f"MASTER_ADDR {addr!r} resolves to {socket.gethostbyname(addr)} (loopback), but the job spans {nodes} "
            f"nodes: the others cannot reach it (a hostname mapped to 127.0.1.1 in /etc/hosts does this). Give "
            f"torchrun --local-addr <this node's IP> on every node (and --rdzv-conf is_host=true on the rendezvous "
            f"host), or fix /etc/hosts"
        )
    if rank != 0:
        wait_reachable(addr, int(port), connect_timeout)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # rank 0 will listen on the port itself
        port_free("" if not is_loopback(addr) else "127.0.0.1", int(port))


def bound_store(host: str, port: int, sock: socket.socket | None = None):
    """A TCPStore server listening on ``host`` only, for ranks that join it as clients.

    A TCPStore server started by rank 0 listens on every interface. rpcmp hosts the
    store itself on a socket bound to the chosen address, and every rank joins it as
    a client, as ranks join torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE``).
    The store owns the listening socket (closing it under a running store aborts the
    process); keep the store alive as long as the job. ``sock``: the port already bound
    (held since it was picked: [Note: ports below the ephemeral range]).
    """
    import torch.distributed as dist
    if sock is None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise NetworkError(f"cannot listen on {host}:{port} ({exc.strerror}): is the port in use, or {host} "
                               f"not an address of this machine?") from None
    sock.listen(128)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach(),
                         use_libuv=False)
