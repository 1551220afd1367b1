"""--api-key on every /v1 route (401 in OpenAI's format, before the body is read), /health and
/metrics open; CORS only for --allowed-origins (none by default); the key from
TOKENCACHE_API_KEY; a warning for a non-loopback host served without a key; the Host check
(--allowed-hosts) against DNS rebinding."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from serve_helpers import MODEL, make_engine

from tokencache_serve import ServerConfig, create_app
from tokencache_serve.cli import API_KEY_ENV, build_parser, server_config, warn_if_exposed
from tokencache_serve.runner import BackgroundServer

KEY = "sk-test-0123456789"
C = "/v1/completions"
GOOD = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def keyed(tiny: Any) -> Iterator[BackgroundServer]:
    app = create_app(
        make_engine(tiny, num_slots=1024),
        tiny[2],
        ServerConfig(model_name=MODEL, api_key=KEY, allowed_origins=("https://ok.example",)),
    )
    with BackgroundServer(app) as srv:
        yield srv


def call(
    url: str,
    path: str,
    method: str = "GET",
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", C), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"), ("GET", "/v1/models/x")],
)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", f"Basic {KEY}", "Bearer"])
def test_every_v1_route_needs_the_key(
    keyed: BackgroundServer, method: str, path: str, auth: str | None
) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    body = GOOD if method == "POST" else None
    status, h, raw = call(keyed.url, path, method, body, headers)
    assert status == 401 and h["www-authenticate"] == "Bearer"
    err = json.loads(raw)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert KEY not in raw.decode() and "wrong" not in raw.decode()  # never echoed


def test_the_right_key_is_served_and_probes_stay_open(keyed: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    for path in ("/health", "/metrics"):
        assert call(keyed.url, path)[0] == 200


def test_cors_only_for_allowed_origins(keyed: BackgroundServer, tiny: Any) -> None:
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization,content-type"
    status, h, _ = call(keyed.url, C, "OPTIONS", headers=preflight)
    assert status == 200 and h["access-control-allow-origin"] == "https://ok.example"
    status, h, _ = call(keyed.url, C, "OPTIONS", headers={**preflight, "Origin": "https://evil"})
    assert status == 400 and "access-control-allow-origin" not in h
    auth = {"Authorization": f"Bearer {KEY}", "Origin": "https://ok.example"}
    status, h, _ = call(keyed.url, C, "POST", GOOD, auth)
    assert status == 200 and h["access-control-allow-origin"] == "https://ok.example"
    # by default: no CORS headers at all, so a browser page elsewhere cannot read a response
    app = create_app(make_engine(tiny, num_slots=1024), tiny[2], ServerConfig(model_name=MODEL))
    with BackgroundServer(app) as srv:
        status, h, _ = call(srv.url, C, "POST", GOOD, {"Origin": "https://ok.example"})
        assert status == 200 and not any(k.startswith("access-control") for k in h)
        status, h, _ = call(srv.url, C, "OPTIONS", headers=preflight)
        assert status == 405 and not any(k.startswith("access-control") for k in h)


def test_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_config(build_parser().parse_args(["serve"])).api_key == "from-env"
    flagged = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert server_config(flagged).api_key == "flag"  # the flag wins
    monkeypatch.delenv(API_KEY_ENV)
    assert server_config(build_parser().parse_args(["serve"])).api_key is None
    a = build_parser().parse_args(["serve", "--allowed-origins", "https://a, https://b"])
    assert server_config(a).allowed_origins == ("https://a", "https://b")


def test_warning_for_an_exposed_host_without_a_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="tokencache_serve")
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert not warn_if_exposed(host, None)
    assert not warn_if_exposed("0.0.0.0", KEY)
    assert not caplog.records
    assert warn_if_exposed("0.0.0.0", None) and warn_if_exposed("my-host.example", None)
    assert all(API_KEY_ENV in r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 2


def test_flags_in_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--api-key",
        "--allowed-origins",
        "--allowed-hosts",
        "--max-body-bytes",
        "--max-prompt-tokens",
        "--max-tokens-limit",
        "--header-timeout",
        "--body-timeout",
        "--max-connections",
        "--tokenizer-threads",
        API_KEY_ENV,
    ):
        assert flag in out


def test_host_check_against_dns_rebinding(tiny: Any) -> None:
    """A page on evil.example that rebinds its DNS to 127.0.0.1 is same-origin to itself (no
    preflight, any Content-Type), but its requests name its own host: refused."""
    import http.client

    from tokencache_serve.security import LOOPBACK_HOSTS

    config = ServerConfig(model_name=MODEL, allowed_hosts=LOOPBACK_HOSTS)
    app = create_app(make_engine(tiny, num_slots=1024), tiny[2], config)
    with BackgroundServer(app) as srv:
        for host, want in (
            (f"127.0.0.1:{srv.port}", 200),
            (f"localhost:{srv.port}", 200),
            (f"[::1]:{srv.port}", 200),
            ("localhost", 200),
            (f"evil.example:{srv.port}", 400),
            (f"localhost.evil.example:{srv.port}", 400),
            ("", 400),
        ):
            conn = http.client.HTTPConnection(srv.host, srv.port, timeout=30)
            conn.putrequest("POST", C, skip_host=True)
            conn.putheader("Host", host)
            data = json.dumps(GOOD).encode()
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(data)))
            conn.endheaders(data)
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == want, (host, body)
            if want == 400:
                assert body["error"]["code"] == "invalid_host"
            conn.close()


def test_allowed_hosts_defaults() -> None:
    from tokencache_serve.security import LOOPBACK_HOSTS

    def hosts(*argv: str) -> Any:
        return server_config(build_parser().parse_args(["serve", *argv])).allowed_hosts

    assert hosts() == LOOPBACK_HOSTS  # --host 127.0.0.1
    assert hosts("--host", "0.0.0.0") is None  # reached by other names: any host
    assert hosts("--host", "0.0.0.0", "--allowed-hosts", "api.example, 10.0.0.2") == (
        "api.example",
        "10.0.0.2",
    )
    assert hosts("--allowed-hosts", "*") is None
