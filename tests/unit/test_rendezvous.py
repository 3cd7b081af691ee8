"""The trainers' rendezvous on one node (host/rendezvous.py): the store serves its clients and listens on loopback
alone, where torch's own TCPStore server would listen on every interface."""

from __future__ import annotations

from pathlib import Path

from colocate.host.rendezvous import LOOPBACK, loopback_store

LISTEN = "0A"  # the kernel's TCP state of a listening socket (/proc/net/tcp)


def listening_addresses(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp{,6} writes them) of the sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, hex_port = fields[1].rpartition(":")
            if fields[3] == LISTEN and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_the_store_serves_clients_and_listens_on_loopback_only():
    from datetime import timedelta

    from torch.distributed import TCPStore

    store, port = loopback_store(LOOPBACK, timeout=timedelta(seconds=30))
    client = TCPStore(LOOPBACK, port, is_master=False, timeout=timedelta(seconds=30))
    client.set("rank0", "here")
    assert store.get("rank0") == b"here"
    assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, little-endian hex; no '::', no 0.0.0.0
