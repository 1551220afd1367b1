"""Limits one client cannot get past and the server's responsiveness: the body size (413 before
the body is read), JSON bodies only (415), the body and header deadlines (slow clients), the
connection cap, prompt and max_tokens limits (400); and /health and other streams answer while
one prompt is being tokenized (off the event loop)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from serve_helpers import MODEL, RawStream, make_engine, post_json, post_raw

from tokencache_serve import ServerConfig, create_app
from tokencache_serve.runner import BackgroundServer

C = "/v1/completions"
GOOD = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}


@contextmanager
def server(tiny: Any, tokenizer: Any = None, **kw: Any) -> Iterator[BackgroundServer]:
    """A server over a fresh engine; kw: ServerConfig fields, or BackgroundServer's
    header_timeout_s / max_connections."""
    net = {k: kw.pop(k) for k in ("header_timeout_s", "max_connections") if k in kw}
    eng = make_engine(tiny, num_slots=1024)
    app = create_app(eng, tokenizer or tiny[2], ServerConfig(model_name=MODEL, **kw))
    with BackgroundServer(app, **net) as srv:
        yield srv


def raw_request(srv: BackgroundServer, head: bytes, body: bytes = b"") -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=30)
    sock.sendall(head + body)
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of one response (Content-Length framed)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        part = sock.recv(65536)
        assert part, f"connection closed before a response: {buf!r}"
        buf += part
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    while len(rest) < int(headers["content-length"]):
        part = sock.recv(65536)
        assert part
        rest += part
    return status, headers, json.loads(rest)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closes the connection (generous liveness timeout)."""
    sock.settimeout(30)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def head(length: int | str, ctype: str = "application/json", extra: str = "") -> bytes:
    return (
        f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {length}\r\n{extra}\r\n"
    ).encode()


def test_body_size_limit(tiny: Any) -> None:
    with server(tiny, max_body_bytes=1024, header_timeout_s=0.5) as srv:
        # announced too large: refused before a byte of the body is sent
        sock = raw_request(srv, head(10**9))
        status, _, body = read_response(sock)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        # the rest is dropped as it comes, for the header timeout at most: then closed
        with pytest.raises(OSError):
            for _ in range(10_000):
                sock.sendall(b" " * 65536)
                threading.Event().wait(0.001)
        sock.close()
        # a client that writes its whole body before reading (and asks to close, as urllib
        # does) still reads the 413: more than socket buffers hold, so it is still writing
        status, body = post_json(srv.url, C, {**GOOD, "prompt": "t1 " * 6_000_000})
        assert status == 413 and body["error"]["code"] == "request_too_large"
        # chunked, growing past the limit: refused once it has, not after all of it
        sock = raw_request(
            srv,
            f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode(),
            b"800\r\n" + b" " * 0x800 + b"\r\n",
        )
        status, _, body = read_response(sock)
        assert status == 413
        sock.close()
        # at the limit: served
        pad = json.dumps({**GOOD, "user": ""}).encode()
        fill = {**GOOD, "user": "u" * (1024 - len(pad))}
        assert len(json.dumps(fill).encode()) == 1024
        assert post_json(srv.url, C, fill)[0] == 200


@pytest.mark.parametrize(
    "ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_json_bodies_only(tiny: Any, ctype: str | None) -> None:
    """A browser may POST text/plain (and the two others) cross-site without a preflight."""
    import urllib.error
    import urllib.request

    with server(tiny) as srv:
        req = urllib.request.Request(srv.url + C, data=json.dumps(GOOD).encode(), method="POST")
        if ctype is not None:
            req.add_header("Content-Type", ctype)
        else:  # urllib adds form-urlencoded to a bodied POST unless told otherwise
            req.add_header("Content-Type", "")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 415
        err = json.loads(e.value.read())["error"]
        assert err["code"] == "unsupported_media_type" and "application/json" in err["message"]
        # a charset parameter is fine
        req = urllib.request.Request(srv.url + C, data=json.dumps(GOOD).encode(), method="POST")
        req.add_header("Content-Type", "application/json; charset=utf-8")
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200


def test_slow_body_gets_408(tiny: Any) -> None:
    with server(tiny, body_timeout_s=0.5) as srv:
        sock = raw_request(srv, head(100), b'{"model": ')  # and then nothing
        status, _, body = read_response(sock)
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert closed_by_server(sock)
        assert post_json(srv.url, C, GOOD)[0] == 200


def test_slow_or_silent_headers_are_closed(tiny: Any) -> None:
    with server(tiny, header_timeout_s=0.5) as srv:
        silent = socket.create_connection((srv.host, srv.port), timeout=30)
        partial = raw_request(srv, f"POST {C} HTTP/1.1\r\nHost: x\r\n".encode())
        assert closed_by_server(silent) and closed_by_server(partial)
        # after a complete exchange, the next request's head has the same deadline
        sock = raw_request(srv, head(len(json.dumps(GOOD))), json.dumps(GOOD).encode())
        status, _, _ = read_response(sock)
        assert status == 200
        sock.sendall(b"POST /v1/comp")
        assert closed_by_server(sock)
        assert post_json(srv.url, C, GOOD)[0] == 200


@pytest.mark.parametrize(
    "junk",
    [b"GARBAGE\r\n\r\n", head("-5"), head("12, 13"), b"POST / HTTP/1.1\r\nBad Header\r\n\r\n"],
)
def test_not_http_gets_a_json_400(tiny: Any, junk: bytes) -> None:
    with server(tiny) as srv:
        status, _, body = read_response(raw_request(srv, junk))
        assert status == 400 and body["error"]["code"] == "invalid_http"
        assert post_json(srv.url, C, GOOD)[0] == 200


def test_connection_cap(tiny: Any) -> None:
    with server(tiny, max_connections=2, header_timeout_s=None) as srv:
        idle = [socket.create_connection((srv.host, srv.port), timeout=30) for _ in range(2)]
        for s in idle:  # both accepted (an exchange on each proves the server has them)
            s.sendall(head(len(json.dumps(GOOD))) + json.dumps(GOOD).encode())
            assert read_response(s)[0] == 200
        over = raw_request(srv, head(len(json.dumps(GOOD))), json.dumps(GOOD).encode())
        status, headers, body = read_response(over)
        assert status == 503 and body["error"]["code"] == "too_many_connections"
        assert headers.get("connection") == "close" and closed_by_server(over)
        for s in idle:
            s.close()
        for _ in range(100):  # the server sees the closes shortly
            if post_json(srv.url, C, GOOD)[0] == 200:
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("still refusing after the idle connections closed")


def test_prompt_and_max_tokens_limits(tiny: Any) -> None:
    with server(tiny, max_prompt_tokens=8, max_tokens_limit=5) as srv:
        status, body = post_json(srv.url, C, {**GOOD, "prompt": [5] * 9})
        assert status == 400 and body["error"]["param"] == "prompt"
        assert "--max-prompt-tokens" in body["error"]["message"]
        status, body = post_json(srv.url, C, {**GOOD, "prompt": " ".join(["t1"] * 9)})
        assert status == 400 and body["error"]["param"] == "prompt"
        status, body = post_json(srv.url, C, {**GOOD, "max_tokens": 6})
        assert status == 400 and body["error"]["param"] == "max_tokens"
        assert post_json(srv.url, C, {**GOOD, "prompt": [5] * 8, "max_tokens": 5})[0] == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "t1"}], "temperature": 0}
        status, r = post_json(srv.url, "/v1/chat/completions", chat)  # default capped at 5
        assert status == 200 and r["usage"]["completion_tokens"] <= 5


class BlockingTokenizer:
    """The tiny tokenizer, whose encode of a prompt containing BLOCK waits until released:
    a tokenization that takes as long as the test wants."""

    BLOCK = "t77 t77 t77"

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, text: str, **kw: Any) -> Any:
        if self.BLOCK in text:
            self.entered.set()
            assert self.release.wait(60), "never released"
        return self._inner.encode(text, **kw)


def test_health_and_streams_answer_during_a_long_tokenization(tiny: Any) -> None:
    import urllib.request

    tok = BlockingTokenizer(tiny[2])
    with server(tiny, tokenizer=tok) as srv:
        results: list[tuple[int, Any]] = []
        slow = threading.Thread(
            target=lambda: results.append(
                post_json(srv.url, C, {**GOOD, "prompt": BlockingTokenizer.BLOCK})
            )
        )
        slow.start()
        try:
            assert tok.entered.wait(30)
            # the event loop is free: /health, and a whole stream, while the prompt tokenizes
            with urllib.request.urlopen(srv.url + "/health", timeout=10) as r:
                assert r.status == 200
            raw = RawStream(srv.host, srv.port, C, {**GOOD, "prompt": "t1 t2", "stream": True})
            raw.read_events(10_000)
            assert raw.events()[-1] == b"[DONE]"
            raw.close()
            assert not results  # still tokenizing
        finally:
            tok.release.set()
            slow.join(60)
        ((status, body),) = results
        assert status == 200, body


def test_tokenizer_failure_is_a_clean_500(tiny: Any) -> None:
    class Broken(BlockingTokenizer):
        def encode(self, text: str, **kw: Any) -> Any:
            raise RuntimeError("planted tokenizer fault")

    with server(tiny, tokenizer=Broken(tiny[2])) as srv:
        status, body = post_json(srv.url, C, {**GOOD, "prompt": "t1"})
        assert status == 500 and "planted" not in json.dumps(body)
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert post_json(srv.url, C, GOOD)[0] == 200  # token ids need no tokenizer


def test_oversized_requests_count_under_a_bounded_label(tiny: Any) -> None:
    """Arbitrary paths must not create metrics series (memory a client could grow)."""
    with server(tiny) as srv:
        for i in range(5):
            post_raw(srv.url, f"/nope/{i}", b"{}", method="GET")
        import urllib.request

        with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert "/nope/" not in text and 'endpoint="other",status="404"} 5.0' in text
