"""free_port(): a TCP port for rank 0's rendezvous store in a test that starts its own job."""
import random
import socket
from pathlib import Path


def free_port():
    """A port nobody listens on now, below the kernel's ephemeral range: the source ports of
    outgoing connections (the other tests' Gloo meshes) come from that range, so none of them
    can take the port before the store listens on it; picked at random so that tests running
    side by side rarely pick the same one."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    pick = random.SystemRandom()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {max(1024, low - 12000)}..{low - 1}")
