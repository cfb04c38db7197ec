"""The c10d store a coordinator hosts for the collective backend's rendezvous, and nothing else: each generation's
process group rendezvouses under a prefix of its own (`protocol.new_store_prefix`), and the keys of generations
long gone are deleted, so the store stays flat however many recoveries a job goes through.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


class RendezvousStore:
    def __init__(self, address: str, *, timeout_s: float, sock: socket.socket | None = None) -> None:
        """The store, listening on `address` only (its own bind would take every interface), or on the listening
        socket `sock` (a restarted coordinator's predecessor's); the socket stays open as long as the store."""
        self.socket = sock or socket.create_server((address, 0), backlog=1024)
        self.store = dist.TCPStore(
            address,
            self.socket.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            master_listen_fd=self.socket.fileno(),
            timeout=timedelta(seconds=timeout_s),
        )
        self.port = self.store.port

    def num_keys(self) -> int:
        return self.store.num_keys()

    def forget_before(self, generation: int) -> None:
        """Delete the rendezvous keys of every generation numbered below `generation`."""
        for key in self.store.list_keys():
            number = key.split("/gen", 1)[-1].split("/", 1)[0]
            if number.isdigit() and int(number) < generation:
                self.store.delete_key(key)
