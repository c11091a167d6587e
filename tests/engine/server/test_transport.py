"""Slow and piled-up sockets against the real transport: head and body deadlines, the connection cap."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from headroom.engine.server.transport import HTTPLimits

from tests.engine.server_fixtures import running_server

LIMITS = HTTPLimits(header_timeout_s=0.6, body_timeout_s=0.6, max_connections=12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("model"), limits=LIMITS) as running:
        yield running


def _connect(base_url: str, payload: bytes) -> socket.socket:
    address = urlsplit(base_url)
    sock = socket.create_connection((address.hostname, address.port), timeout=10)
    if payload:
        sock.sendall(payload)
    return sock


def _read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    started, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - started


def _status_and_error(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


@pytest.mark.parametrize("payload", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"])
def test_half_a_head_gets_408_and_is_closed_after_the_head_timeout(server, payload):
    socks = [_connect(server.base_url, payload) for _ in range(4)]
    for sock in socks:
        raw, waited = _read_until_closed(sock)
        assert waited < LIMITS.header_timeout_s + 2
        status, error = _status_and_error(raw)
        assert status == 408 and "request head not received within 0.6 s" in error["message"]
        sock.close()


def test_half_a_body_gets_408_and_is_closed_after_the_body_timeout(server):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n")
    socks = [_connect(server.base_url, head + b'{"prompt": ') for _ in range(4)]
    for sock in socks:
        raw, waited = _read_until_closed(sock)
        assert waited < LIMITS.body_timeout_s + 2
        status, error = _status_and_error(raw)
        assert status == 408 and error["code"] == "request_timeout" and "11 bytes arrived" in error["message"]
        sock.close()


def test_a_kept_alive_connection_that_starts_a_second_head_slowly_is_timed_out(server):
    sock = _connect(server.base_url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    first = b""
    while b'"live"' not in first:
        first += sock.recv(65536)
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")
    raw, waited = _read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 408") and waited < LIMITS.header_timeout_s + 2
    sock.close()


def test_connections_beyond_the_cap_get_503_and_service_resumes_once_they_are_reaped(server):
    held = [_connect(server.base_url, b"GET /heal") for _ in range(LIMITS.max_connections)]
    time.sleep(0.1)
    extra = _connect(server.base_url, b"")
    raw, waited = _read_until_closed(extra)
    status, error = _status_and_error(raw)
    assert status == 503 and "max_connections=12" in error["message"] and waited < 1.0
    extra.close()
    for sock in held:
        _read_until_closed(sock)
        sock.close()
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200


def test_limits_are_checked():
    with pytest.raises(ValueError, match="header_timeout_s must be > 0 seconds, got 0"):
        HTTPLimits(header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections must be >= 1, got 0"):
        HTTPLimits(max_connections=0)
