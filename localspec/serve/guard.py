"""What a web page must not be able to do to a server on this machine.

- Host: a page on evil.example whose name is made to resolve to 127.0.0.1 (DNS
  rebinding) sends its requests with `Host: evil.example`, and the browser lets it read
  the replies. So a request must name this server: a loopback name (localhost,
  127.0.0.1, ::1), the --host value, or an --allowed-host (`*` allows any, `*.lan` a
  domain); others get a 403. A server bound to every interface (0.0.0.0, ::) also
  answers any IP-address Host, which no rebinding can produce (the page's origin would
  be that address itself), and this machine's host name.
- Content-Type: a page may POST `text/plain` (or a form) to any address without a
  CORS preflight; a POST here must be `application/json` (any parameters, e.g.
  charset), else a 415 in OpenAI's error shape, so such a request never runs.
- CORS: no Access-Control-Allow-Origin unless --cors-origin names origins
  (Starlette's CORSMiddleware then answers preflights and adds the headers).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from localspec.serve.protocol import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
_BODY_METHODS = ("POST", "PUT", "PATCH")


def host_name(header: str) -> str | None:
    """The name in a Host header, lower-case, without its port ('[::1]:8080' -> '::1');
    None when it is malformed."""
    header = header.strip().lower()
    if header.count(":") > 1 and not header.startswith("["):  # a bare IPv6 address
        return header if _is_ip(header) else None
    if header.startswith("["):
        name, sep, rest = header[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return name
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return None
    return name or None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostCheck:
    """Which Host names this server answers (see the module's docstring)."""

    def __init__(self, bind: str, allowed: Iterable[str] = ()) -> None:
        extra = [a.strip().lower() for a in allowed if a.strip()]
        self.any = "*" in extra
        self.domains = tuple(a[1:] for a in extra if a.startswith("*."))  # ".lan"
        names = {*LOOPBACK_NAMES, bind.strip("[]").lower(), *(a for a in extra if not a.startswith("*"))}
        self.wildcard = bind in WILDCARDS
        if self.wildcard:
            hostname = socket.gethostname().lower()
            names |= {hostname, f"{hostname}.local"}
        self.names = frozenset(n for n in names if n not in WILDCARDS)

    def allows(self, header: str | None) -> bool:
        if self.any or header is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        name = host_name(header)
        if name is None:
            return False
        name = name.rstrip(".")
        return (name in self.names or name.endswith(self.domains)
                or (self.wildcard and _is_ip(name)))

    def described(self) -> str:
        names = ", ".join(sorted(self.names))
        return names + (", any IP address" if self.wildcard else "")


def _refuse(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


class HostMiddleware:
    """A request whose Host names another server gets a 403, before any route runs."""

    def __init__(self, app: ASGIApp, hosts: HostCheck) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if not self.hosts.allows(host):
                shown = (host or "")[:100]
                error = ApiError(403, f"The Host header '{shown}' does not name this server (it answers "
                                      f"{self.hosts.described()}); start it with --allowed-host NAME to "
                                      "answer another name.", type="permission_error", code="host_not_allowed")
                await _refuse(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class JsonBodyMiddleware:
    """A POST (PUT, PATCH) whose Content-Type is not application/json gets a 415."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in _BODY_METHODS:
            given = Headers(scope=scope).get("content-type")
            if (given or "").partition(";")[0].strip().lower() != "application/json":
                said = f"the header 'Content-Type: {given[:100]}'" if given else "no Content-Type header"
                error = ApiError(415, "Unsupported content type: this API only accepts 'application/json' "
                                      f"request bodies, but the request has {said}.", code="unsupported_media_type")
                await _refuse(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def middleware(bind: str, allowed_hosts: Sequence[str] = (), cors_origins: Sequence[str] = ()) -> list[Middleware]:
    """The app's middleware, outermost first: the Host check, CORS when asked for (so a
    page of an allowed origin can read a 415 it caused), the Content-Type check."""
    cors = [Middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])] if cors_origins else []
    return [Middleware(HostMiddleware, hosts=HostCheck(bind, allowed_hosts)), *cors, Middleware(JsonBodyMiddleware)]
