"""The benchmarks' wide-area proxy (bench/wanproxy.py) carries bytes unchanged.

Only correctness is asserted here: what one end sends, the other receives, in
both directions and with several connections at once. Its timing is measured by
the benchmarks, never asserted in a test.
"""

from __future__ import annotations

import random
import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from wanproxy import LinkSpec, WanProxy


def _echo_reversed_server() -> tuple[socket.socket, threading.Thread]:
    """A server that reads everything a client sends, then answers with it reversed."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    def handle(conn: socket.socket) -> None:
        with conn:
            parts = []
            while data := conn.recv(65536):
                parts.append(data)
            conn.sendall(b"".join(parts)[::-1])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def _exchange(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sender = threading.Thread(target=lambda: (sock.sendall(payload), sock.shutdown(socket.SHUT_WR)))
        sender.start()
        parts = []
        while data := sock.recv(65536):
            parts.append(data)
        sender.join()
    return b"".join(parts)


@pytest.mark.parametrize(
    "link", [LinkSpec(), LinkSpec(rtt_ms=4, up_mb_s=200, down_mb_s=50)], ids=["unshaped", "shaped"]
)
def test_bytes_pass_unchanged_both_ways(link: LinkSpec) -> None:
    listener, _ = _echo_reversed_server()
    proxy = WanProxy("127.0.0.1", listener.getsockname()[1], link)
    try:
        rng = random.Random(5)
        payloads = [rng.randbytes(n) for n in (0, 1, 70_000, 3_000_000)]
        results: dict[int, bytes] = {}
        threads = [
            threading.Thread(target=lambda i=i, p=p: results.__setitem__(i, _exchange(proxy.port, p)))
            for i, p in enumerate(payloads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, payload in enumerate(payloads):
            assert results[i] == payload[::-1], f"payload {i} ({len(payload)} bytes) changed"
        sent = sum(len(p) for p in payloads)
        assert proxy.stats() == {"connections": 4, "bytes_up": sent, "bytes_down": sent}
    finally:
        proxy.close()
        listener.close()
