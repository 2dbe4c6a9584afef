"""A process's sockets, told apart by their kernel identity: which ones a block of code opened (the gloo pairs
of a process group, a store client), and shutting them down so that whatever waits on them fails at once."""

from __future__ import annotations

import os
import socket

import psutil


def socket_fds() -> dict[int, str]:
    """This process's open file descriptors that are sockets, with the socket's identity (its inode): a number
    the kernel may give to a new socket once the old one is closed, the inode tells them apart."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def shutdown_sockets(sockets: dict[int, str]) -> int:
    """Shut down (both directions) every connected socket among ``sockets`` that is still the same socket;
    returns how many. The descriptors stay open — their owners close them."""
    done = 0
    for fd, identity in sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != identity:
                continue  # closed, and the number now belongs to another socket
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
        except OSError:
            pass
        finally:
            sock.close()  # closes the duplicate only
    return done


class SocketScope:
    """``with SocketScope() as scope:`` — afterwards ``scope.sockets`` are the sockets opened inside the block
    and still open at its end (fd -> identity)."""

    def __enter__(self) -> "SocketScope":
        self._before = set(socket_fds().values())
        self.sockets: dict[int, str] = {}
        return self

    def __exit__(self, *exc) -> None:
        self.sockets = {fd: ident for fd, ident in socket_fds().items() if ident not in self._before}


def connections_to(port: int) -> int:
    """This process's established TCP connections whose far end is ``port`` (a store's clients: on one host a
    port names one store)."""
    return sum(1 for c in _tcp(psutil) if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def connected_to(sockets: dict[int, str], port: int) -> dict[int, str]:
    """Those of ``sockets`` (fd -> identity) whose far end is ``port``: of the sockets that appeared while a store
    client was made, the client's own (another thread may have opened one meanwhile)."""
    ours = {c.fd for c in _tcp(psutil) if c.raddr and c.raddr.port == port}
    return {fd: identity for fd, identity in sockets.items() if fd in ours}


def _tcp(psutil) -> list:
    """This process's TCP connections (``net_connections`` from psutil 6, ``connections`` before)."""
    process = psutil.Process()
    return (process.net_connections if hasattr(process, "net_connections") else process.connections)(kind="tcp")
