"""The test registries where the multi-node cluster's nodes find them: at localhost:5000 and
localhost:5001 inside each node's network namespace (as a cluster's registry has one name on
every node), each connection forwarded to the registry on this machine's loopback.

Run by .ci/provision.sh (part 5e) as root: `python3 nodes.py NETNS...`. Listening sockets are
made inside each node's namespace (a socket stays in the namespace it was made in); the
connections to the registries are made from this machine's own."""

import contextlib
import os
import socket
import sys
import threading

PORTS = (5000, 5001)


def pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    for end in (source, sink):
        with contextlib.suppress(OSError):
            end.shutdown(socket.SHUT_RDWR)


def serve(listener: socket.socket, port: int) -> None:
    while True:
        client, _ = listener.accept()
        try:
            registry = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            client.close()
            continue
        registry.settimeout(None)
        for ends in ((client, registry), (registry, client)):
            threading.Thread(target=pipe, args=ends, daemon=True).start()


def listen_in(netns: str) -> list[tuple[socket.socket, int]]:
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        os.setns(target, os.CLONE_NEWNET)
        listeners = []
        for port in PORTS:
            listener = socket.socket()
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(64)
            listeners.append((listener, port))
        return listeners
    finally:
        os.setns(own, os.CLONE_NEWNET)
        os.close(own)
        os.close(target)


def main(namespaces: list[str]) -> None:
    servers = [
        threading.Thread(target=serve, args=pair, daemon=True)
        for netns in namespaces
        for pair in listen_in(netns)
    ]
    for server in servers:
        server.start()
    for server in servers:
        server.join()


if __name__ == "__main__":
    main(sys.argv[1:])
