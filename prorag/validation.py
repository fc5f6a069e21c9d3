"""Checks of what a caller's config names, before anything runs: plain names, paths inside the data root,
endpoints on an allowlist.

A job config is written by whoever may call StartJob, and the trainer acts on it with its own rights: a
name becomes part of a path it writes, a path is read (or written), an endpoint is dialled (and, for an
OpenAI-compatible URL, handed the trainer's API key). So each is checked here, and refused with
InvalidArgument naming the field. Pure functions (no I/O beyond resolving a path), so every service can
use them.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from pathlib import Path
from typing import Iterable, Sequence
from urllib.parse import urlsplit

from prorag import paths
from prorag.errors import InvalidArgument

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: loopback (and the unspecified addresses, which dial this machine too: what `prorag up --host 0.0.0.0` puts
#: in job configs), and the service names of compose.yaml and k8s/ (``prorag-*`` also covers their cluster FQDNs)
DEFAULT_ALLOWED_ENDPOINTS: tuple[str, ...] = ("127.0.0.0/8", "::1", "0.0.0.0", "::", "localhost", "retriever",
                                              "policy", "prm", "judge", "prorag-*")


# ---------------------------------------------------------------- names and paths
def check_name(field: str, value: str) -> str:
    """``value`` as a plain name (it becomes one part of a path): 1-128 letters, digits, '.', '_' or '-',
    starting with a letter or digit; never '..' nor a '/'."""
    if not isinstance(value, str) or not NAME_RE.match(value) or ".." in value:
        raise InvalidArgument(f"{field} {value!r}: must be a plain name (1-128 letters, digits, '.', '_' or '-', "
                              f"starting with a letter or digit, no '..'), since it becomes part of a path")
    return value


def data_roots(extra: Iterable[str | Path] = ()) -> list[Path]:
    """The directories a config's paths may point into: PRORAG_HOME, the data and runs directories (each may
    be moved out of it by PRORAG_DATA / PRORAG_RUNS), and ``extra`` (e.g. the trainer's jobs root)."""
    out: list[Path] = []
    for p in (paths.home(), paths.data_dir(), paths.runs_dir(), *extra):
        r = Path(p).resolve()
        if r not in out:
            out.append(r)
    return out


def check_path(field: str, value: str, roots: Sequence[str | Path]) -> Path:
    """``value`` resolved (symlinks and '..' followed, a relative path from the working directory); it must lie
    inside one of ``roots``, else InvalidArgument naming the field."""
    if not isinstance(value, str) or not value or "\x00" in value:
        raise InvalidArgument(f"{field} {value!r}: expected a path")
    resolved = Path(value).resolve()
    allowed = [Path(r).resolve() for r in roots]
    if not any(resolved == r or resolved.is_relative_to(r) for r in allowed):
        raise InvalidArgument(f"{field} {value!r} resolves to {resolved}, outside the data root "
                              f"({', '.join(map(str, allowed))}); use a path under PRORAG_HOME")
    return resolved


# ---------------------------------------------------------------- endpoints
def _host_port(addr: str, where: str) -> tuple[str, int | None]:
    """'host', 'host:port', '[v6]:port' or a bare IPv6 address -> (host, port or None)."""
    if addr.startswith("["):
        host, sep, rest = addr[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise InvalidArgument(f"{where}: cannot read the address {addr!r}")
        port = rest[1:] if rest else None
    elif addr.count(":") == 1:
        host, port = addr.split(":")
    elif addr.count(":") == 0:
        host, port = addr, None
    else:  # an IPv6 address without brackets (and so without a port)
        host, port = addr, None
    host = host.strip()
    if not host or not re.fullmatch(r"[A-Za-z0-9._:%-]+", host):
        raise InvalidArgument(f"{where}: cannot read the host of {addr!r}")
    if port is None or port == "":
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{where}: port {port!r} of {addr!r} is not a port number")
    return host, int(port)


def parse_target(target: str, where: str = "target") -> list[tuple[str, int | None]]:
    """Every (host, port) a gRPC target makes a client dial: ``host:port``, ``[v6]:port``,
    ``dns:///host:port``, ``dns://dns-server/host:port`` (the DNS server is dialled too), and the address lists
    ``ipv4:a:p,b:p`` / ``ipv6:[a]:p,[b]:p``. Other schemes (unix:, xds:, ...) are refused."""
    t = (target or "").strip()
    if not t:
        raise InvalidArgument(f"{where}: empty endpoint")
    if t.startswith("dns:"):
        rest, out = t[4:], []
        if rest.startswith("//"):
            authority, _, rest = rest[2:].partition("/")
            if authority:
                out.append(_host_port(authority, where))
        return out + [_host_port(rest, where)]
    for scheme in ("ipv4:", "ipv6:"):
        if t.startswith(scheme):
            return [_host_port(a.strip(), where) for a in t[len(scheme):].split(",") if a.strip()] or \
                [_host_port("", where)]
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:(?!\d+$)", t) and not t.startswith("["):
        raise InvalidArgument(f"{where}: {t!r} uses a target scheme the trainer does not dial for jobs; give "
                              f"host:port, dns:///host:port or ipv4:/ipv6: address lists")
    return [_host_port(t, where)]


def parse_url(url: str, where: str = "url") -> tuple[str, int]:
    """(host, port) of an http(s) URL; other schemes are refused."""
    parts = urlsplit((url or "").strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidArgument(f"{where}: {url!r} is not an http(s) URL")
    try:
        port = parts.port
    except ValueError:
        raise InvalidArgument(f"{where}: {url!r} has an invalid port") from None
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def _ip(host: str):
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def _split_pattern(pattern: str) -> tuple[str, int | None]:
    p = pattern.strip()
    if "/" in p:  # a network: never has a port
        return p, None
    if p.startswith("[") or p.count(":") == 1:
        host, port = _host_port(p, f"allowed endpoint {pattern!r}")
        return host, port
    return p, None


def host_matches(host: str, pattern: str) -> bool:
    """One host against one host pattern: an IP network (127.0.0.0/8), an IP, or a name with * wildcards.
    A name pattern never matches an IP literal (a '127.*' must not let '127.evil.example' in, nor the reverse)."""
    ip = _ip(host)
    if "/" in pattern:
        try:
            net = ipaddress.ip_network(pattern, strict=False)
        except ValueError:
            return False
        return ip is not None and ip.version == net.version and ip in net
    pat_ip = _ip(pattern)
    if pat_ip is not None:
        return ip is not None and ip == pat_ip
    if ip is not None:
        return False
    return fnmatch.fnmatchcase(host.lower().rstrip("."), pattern.lower().rstrip("."))


def endpoint_allowed(host: str, port: int | None, allowed: Sequence[str]) -> bool:
    for pattern in allowed:
        phost, pport = _split_pattern(pattern)
        if pport is not None and pport != port:
            continue
        if host_matches(host, phost):
            return True
    return False


def _refuse(field: str, value: str, host: str, port: int | None, allowed: Sequence[str]) -> InvalidArgument:
    shown = f"{host}:{port}" if port is not None else host
    return InvalidArgument(f"{field} {value!r}: {shown} is not on this trainer's allowed endpoints "
                           f"({', '.join(allowed) or 'none'}); use one of those, or ask its operator to add it to "
                           f"allowed_endpoints")


def check_endpoint(field: str, value: str, allowed: Sequence[str]) -> None:
    """Every address the gRPC target ``value`` dials must be on ``allowed``."""
    for host, port in parse_target(value, field):
        if not endpoint_allowed(host, port, allowed):
            raise _refuse(field, value, host, port, allowed)


def check_url(field: str, value: str, allowed: Sequence[str]) -> None:
    """The host (and port) of the http(s) URL ``value`` must be on ``allowed``."""
    host, port = parse_url(value, field)
    if not endpoint_allowed(host, port, allowed):
        raise _refuse(field, value, host, port, allowed)


def check_allowed_endpoints(patterns: Sequence[str]) -> list[str]:
    """An operator's allowlist, each pattern readable (so a typo fails at start, not at every job)."""
    out = []
    for p in patterns:
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"allowed_endpoints: empty pattern in {list(patterns)!r}")
        host, _ = _split_pattern(p)
        if "/" in host:
            try:
                ipaddress.ip_network(host, strict=False)
            except ValueError as e:
                raise ValueError(f"allowed_endpoints: {p!r} is not a network ({e})") from None
        out.append(p.strip())
    return out


__all__ = ["NAME_RE", "DEFAULT_ALLOWED_ENDPOINTS", "check_name", "data_roots", "check_path", "parse_target",
           "parse_url", "host_matches", "endpoint_allowed", "check_endpoint", "check_url", "check_allowed_endpoints"]
