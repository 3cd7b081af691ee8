"""Where a process group's ranks meet: a free port on this node, or a TCPStore that listens on loopback alone.

    address, port = free_port()            # ranks on several nodes: rank 0's init_process_group hosts the store
    store, port = loopback_store(LOOPBACK)  # ranks on one node: this process hosts it now; keep `store` alive

Why: torch's TCPStore server listens on every interface whatever MASTER_ADDR says (torch 2.13: '::' for a store
meant for 127.0.0.1), so anyone who reaches the node could write keys into the rendezvous. Handed a listening
socket (master_listen_fd, as vLLM does in distributed/utils.py create_tcp_store) it listens on that one only.
Hazard: the ranks must then run with TORCHELASTIC_USE_AGENT_STORE=True (the runtime sets it), which makes every
rank's init_process_group a client of this store; without it rank 0 would try to host a second store on the same
port.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

LOOPBACK = "127.0.0.1"


def free_port() -> tuple[str, int]:
    """This node's address (as Ray knows it) and a port free now."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def loopback_store(host: str = LOOPBACK, *, timeout: timedelta = timedelta(minutes=10)):
    """A TCPStore server listening on `host` alone, on a free port; returns (store, port). The store lives as long
    as the returned object: process groups created later (a device mesh) use it too."""
    import torch.distributed as dist

    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen()
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd,
                              timeout=timeout)
    except BaseException:
        os.close(fd)
        raise
    return store, port
