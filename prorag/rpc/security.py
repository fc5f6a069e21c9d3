"""Who may call a ProRAG service, and over what: optional TLS (mutual TLS optional too) and bearer
tokens with scopes, on every gRPC and HTTP endpoint.

Servers and clients read the same environment, so one Secret configures a whole deployment:

=========================  ======  ==================================================================
variable                   side    meaning
=========================  ======  ==================================================================
PRORAG_TLS_CERT / _KEY     server  PEM certificate chain and key: serve TLS instead of plaintext
PRORAG_TLS_CLIENT_CA       server  PEM CA bundle: require client certificates signed by it (mTLS)
PRORAG_AUTH_TOKENS         server  YAML tokens file (below): require ``authorization: Bearer <token>``
PRORAG_TLS_CA              client  PEM CA bundle that verifies the servers (turns TLS on)
PRORAG_TLS_CLIENT_CERT/KEY client  PEM certificate and key presented to servers that require mTLS
PRORAG_TLS_SERVER_NAME     client  name checked against the server certificate (default: the host)
PRORAG_TOKEN_FILE          client  file whose content is the token sent on every call
PRORAG_TOKEN               client  the token itself (PRORAG_TOKEN_FILE wins when both are set)
=========================  ======  ==================================================================

The tokens file (``prorag security tokens`` writes one)::

    tokens:
      - {name: trainer, token: "…", scopes: [call, admin]}
      - {name: team-x, token_sha256: "<hex sha256 of the token>", scopes: [call]}

Scope ``call`` lets a caller search, generate, score and judge; ``admin`` is what starting or
cancelling training jobs and loading, activating or unloading adapters need. The gRPC health
service stays open so that probes and load balancers work without a token. The file is re-read
when it changes (Secrets rotate without a restart).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets as pysecrets
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from prorag.jsontext import describe, invalid_string
from prorag.rpc.grpc_metadata import MetadataInterceptor

log = logging.getLogger("prorag.rpc.security")

SCOPE_CALL = "call"
SCOPE_ADMIN = "admin"
SCOPES = (SCOPE_CALL, SCOPE_ADMIN)

# Methods that change what a service does for everyone: they need the admin scope.
ADMIN_SERVICES = frozenset({"prorag.v1.Trainer"})
ADMIN_METHODS = frozenset({
    "/prorag.v1.Policy/LoadAdapter",
    "/prorag.v1.Policy/ActivateAdapter",
    "/prorag.v1.Policy/UnloadAdapter",
})
OPEN_SERVICES = frozenset({"grpc.health.v1.Health"})


class SecurityConfigError(ValueError):
    """A TLS or token setting that cannot be used; the message names the file or variable."""


def required_scope(method: str) -> str | None:
    """The scope a full gRPC method name (``/pkg.Service/Method``) needs; None = open to anyone.

    >>> required_scope("/prorag.v1.Trainer/StartJob"), required_scope("/prorag.v1.Retriever/Search")
    ('admin', 'call')
    """
    service = method.lstrip("/").split("/", 1)[0]
    if service in OPEN_SERVICES:
        return None
    if service in ADMIN_SERVICES or method in ADMIN_METHODS:
        return SCOPE_ADMIN
    return SCOPE_CALL


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """A caller the tokens file knows."""

    name: str
    scopes: frozenset[str]


def parse_tokens(data: Any, source: str = "tokens file") -> dict[str, Principal]:
    """``{"tokens": [{"name", "token" | "token_sha256", "scopes"}]}`` -> {sha256 hex digest: Principal}."""
    found = invalid_string(data)  # a YAML "\\ud800" escape: a token no header carries, a name no log writes
    if found is not None:
        raise SecurityConfigError(describe(source, *found))
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise SecurityConfigError(f"{source}: expected a mapping with a list under 'tokens', e.g. "
                                  "tokens: [{name: me, token: '...', scopes: [call]}]")
    table: dict[str, Principal] = {}
    for i, entry in enumerate(data["tokens"]):
        where = f"{source}: tokens[{i}]"
        if not isinstance(entry, dict):
            raise SecurityConfigError(f"{where} must be a mapping")
        unknown = set(entry) - {"name", "token", "token_sha256", "scopes"}
        if unknown:
            raise SecurityConfigError(f"{where}: unknown key(s) {sorted(unknown)}")
        name = str(entry.get("name") or f"token-{i}")
        if ("token" in entry) == ("token_sha256" in entry):
            raise SecurityConfigError(f"{where} ({name}): give exactly one of 'token' and 'token_sha256'")
        if "token" in entry:
            token = str(entry["token"])
            if len(token) < 16:
                raise SecurityConfigError(f"{where} ({name}): a token must have at least 16 characters")
            digest = token_digest(token)
        else:
            digest = str(entry["token_sha256"]).lower()
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise SecurityConfigError(f"{where} ({name}): token_sha256 must be 64 hex digits")
        scopes = entry.get("scopes", [SCOPE_CALL])
        if not isinstance(scopes, list) or not scopes or any(s not in SCOPES for s in scopes):
            raise SecurityConfigError(f"{where} ({name}): scopes must be a non-empty list of {list(SCOPES)}")
        if digest in table:
            raise SecurityConfigError(f"{where} ({name}): the same token appears twice")
        table[digest] = Principal(name, frozenset(scopes))
    if not table:
        raise SecurityConfigError(f"{source}: no tokens; with auth on, nobody could call the service")
    return table


class TokenTable:
    """The tokens file, re-read when its modification time changes (checked at most every ``recheck_s``)."""

    def __init__(self, path: str | Path, recheck_s: float = 5.0):
        self.path = Path(path)
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._mtime = -1.0
        self._checked = 0.0
        self._table: dict[str, Principal] = {}
        self._load(force=True)

    def _load(self, force: bool = False) -> None:
        import yaml

        try:
            mtime = self.path.stat().st_mtime
        except OSError as e:
            if force:
                raise SecurityConfigError(f"cannot read the tokens file {self.path}: {e}") from e
            log.warning("tokens file %s unreadable (%s); keeping the tokens read before", self.path, e)
            return
        if mtime == self._mtime and not force:
            return
        try:
            table = parse_tokens(yaml.safe_load(self.path.read_text()), str(self.path))
        except (SecurityConfigError, yaml.YAMLError, OSError, UnicodeDecodeError) as e:  # bytes that are not UTF-8
            if force:
                raise SecurityConfigError(str(e)) from e
            log.error("tokens file %s changed but is invalid (%s); keeping the tokens read before", self.path, e)
            return
        self._table, self._mtime = table, mtime

    def authenticate(self, authorization: str | None) -> Principal | None:
        """The principal of an ``authorization`` header value (``Bearer <token>``), or None."""
        now = time.monotonic()
        if now - self._checked > self.recheck_s:
            with self._lock:
                self._checked = now
                self._load()
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        try:
            digest = token_digest(token.strip())
        except UnicodeEncodeError:  # header bytes that are no UTF-8 (aiohttp keeps them as surrogates): no token
            return None
        # Compare against every entry in constant time, so timing tells nothing about near misses.
        found = None
        for known, principal in self._table.items():
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SecurityConfigError(f"cannot read the {what} {path}: {e}") from e
    if b"-----BEGIN" not in data:
        raise SecurityConfigError(f"the {what} {path} is not PEM (no '-----BEGIN' line)")
    return data


@dataclass
class ServerSecurity:
    """TLS and token settings of one server (all empty = plaintext, no auth: loopback development)."""

    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_tokens: str = ""
    _tokens: TokenTable | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "ServerSecurity":
        env = os.environ if env is None else env
        return cls(tls_cert=env.get("PRORAG_TLS_CERT", ""), tls_key=env.get("PRORAG_TLS_KEY", ""),
                   tls_client_ca=env.get("PRORAG_TLS_CLIENT_CA", ""), auth_tokens=env.get("PRORAG_AUTH_TOKENS", ""))

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecurityConfigError("TLS needs both a certificate and its key (PRORAG_TLS_CERT and PRORAG_TLS_KEY)")
        if self.tls_client_ca and not self.tls_cert:
            raise SecurityConfigError("mutual TLS (PRORAG_TLS_CLIENT_CA) needs server TLS too "
                                      "(PRORAG_TLS_CERT and PRORAG_TLS_KEY)")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def tokens(self) -> TokenTable | None:
        if self.auth_tokens and self._tokens is None:
            self._tokens = TokenTable(self.auth_tokens)
        return self._tokens

    def grpc_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        pair = (_read_pem(self.tls_key, "TLS key"), _read_pem(self.tls_cert, "TLS certificate"))
        ca = _read_pem(self.tls_client_ca, "client CA bundle") if self.tls_client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
            if self.tls_client_ca:
                ctx.load_verify_locations(self.tls_client_ca)
                ctx.verify_mode = ssl.CERT_REQUIRED
        except (OSError, ssl.SSLError) as e:
            raise SecurityConfigError(f"cannot load TLS material ({self.tls_cert}, {self.tls_key}): {e}") from e
        return ctx

    def describe(self) -> str:
        tls = ("mutual TLS" if self.tls_client_ca else "TLS") if self.tls else "plaintext"
        return f"{tls}, {'bearer tokens' if self.auth_tokens else 'no auth'}"


# ---------------------------------------------------------------- gRPC server side
def _aborting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same shape as ``handler`` that only aborts with ``code``."""

    async def unary(request, context):
        await context.abort(code, message)

    async def stream(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    if handler.stream_unary:
        async def stream_unary(request_iterator, context):
            await context.abort(code, message)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)

    async def stream_stream(request_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid bearer token (UNAUTHENTICATED) or without the scope the method
    needs (PERMISSION_DENIED) before the servicer sees them."""

    def __init__(self, tokens: TokenTable, service_name: str):
        self.tokens = tokens
        self.service_name = service_name

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        scope = required_scope(method)
        if handler is None or scope is None:
            return handler
        header = next((v for k, v in (handler_call_details.invocation_metadata or ())
                       if k == "authorization"), None)
        if isinstance(header, bytes):
            header = header.decode("latin-1")
        principal = self.tokens.authenticate(header)
        if principal is None:
            reason = "no 'authorization: Bearer <token>' metadata" if not header else "the token is not valid"
            return _aborting_handler(handler, grpc.StatusCode.UNAUTHENTICATED,
                                     f"{self.service_name}: {reason}; set PRORAG_TOKEN_FILE (or PRORAG_TOKEN) "
                                     "to a token listed in the server's PRORAG_AUTH_TOKENS file")
        if scope not in principal.scopes:
            return _aborting_handler(handler, grpc.StatusCode.PERMISSION_DENIED,
                                     f"{method} needs the '{scope}' scope; the token of '{principal.name}' has "
                                     f"{sorted(principal.scopes)}")
        return handler


# ---------------------------------------------------------------- HTTP server side
def http_auth_middleware(tokens: TokenTable, service_name: str):
    """aiohttp middleware: every path needs the ``call`` scope (HTTP serves no administrative route)."""
    from aiohttp import web

    @web.middleware
    async def middleware(request, handler):
        principal = tokens.authenticate(request.headers.get("Authorization"))
        if principal is None:
            return web.json_response(
                {"error": f"{service_name}: missing or invalid bearer token; send 'Authorization: Bearer <token>'"},
                status=401, headers={"WWW-Authenticate": 'Bearer realm="prorag"'})
        if SCOPE_CALL not in principal.scopes:
            return web.json_response({"error": f"the token of '{principal.name}' lacks the 'call' scope"}, status=403)
        return await handler(request)

    return middleware


# ---------------------------------------------------------------- client side
@dataclass
class ClientSecurity:
    """What a client presents: a CA to verify servers (TLS on), an optional client certificate, a token."""

    token: str = ""
    tls_ca: str = ""
    tls_client_cert: str = ""
    tls_client_key: str = ""
    tls_server_name: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "ClientSecurity":
        env = os.environ if env is None else env
        token = env.get("PRORAG_TOKEN", "")
        if env.get("PRORAG_TOKEN_FILE"):
            try:
                token = Path(env["PRORAG_TOKEN_FILE"]).read_text().strip()
            except OSError as e:
                raise SecurityConfigError(f"cannot read PRORAG_TOKEN_FILE {env['PRORAG_TOKEN_FILE']}: {e}") from e
        return cls(token=token, tls_ca=env.get("PRORAG_TLS_CA", ""),
                   tls_client_cert=env.get("PRORAG_TLS_CLIENT_CERT", ""),
                   tls_client_key=env.get("PRORAG_TLS_CLIENT_KEY", ""),
                   tls_server_name=env.get("PRORAG_TLS_SERVER_NAME", ""))

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_client_cert)

    def authorization(self) -> str | None:
        return f"Bearer {self.token}" if self.token else None

    def ssl_context(self) -> ssl.SSLContext | None:
        """For HTTP clients (urllib, aiohttp)."""
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca or None)
        if self.tls_client_cert:
            ctx.load_cert_chain(self.tls_client_cert, self.tls_client_key or None)
        return ctx


class _TokenMetadata(MetadataInterceptor):
    """Adds the bearer token to every call; works on plaintext loopback channels too, where gRPC's
    call credentials are refused."""

    def __init__(self, authorization: str):
        self.header = ("authorization", authorization)

    def metadata(self, existing):
        return existing + [self.header]


def secure_channel(target: str, options: list[tuple[str, Any]] | None = None,
                   security: ClientSecurity | None = None) -> grpc.Channel:
    """A gRPC channel to ``target`` with the TLS and token ``security`` asks for (default: from the env)."""
    security = ClientSecurity.from_env() if security is None else security
    options = list(options or [])
    if security.tls:
        ca = _read_pem(security.tls_ca, "CA bundle (PRORAG_TLS_CA)") if security.tls_ca else None
        key = (_read_pem(security.tls_client_key, "client key (PRORAG_TLS_CLIENT_KEY)")
               if security.tls_client_key else None)
        cert = (_read_pem(security.tls_client_cert, "client certificate (PRORAG_TLS_CLIENT_CERT)")
                if security.tls_client_cert else None)
        if security.tls_server_name:
            options.append(("grpc.ssl_target_name_override", security.tls_server_name))
        ch = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca, key, cert), options=options)
    else:
        ch = grpc.insecure_channel(target, options=options)
    auth = security.authorization()
    return grpc.intercept_channel(ch, _TokenMetadata(auth)) if auth else ch


# ---------------------------------------------------------------- generating secrets
DEFAULT_TLS_HOSTS = ("localhost", "127.0.0.1", "retriever", "policy", "prm", "judge", "trainer",
                     "prorag-retriever", "prorag-policy", "prorag-policy-headless", "prorag-prm", "prorag-judge",
                     "prorag-trainer")


def generate_secrets(out_dir: str | Path, hosts: tuple[str, ...] = DEFAULT_TLS_HOSTS, days: int = 365,
                     token_names: tuple[tuple[str, tuple[str, ...]], ...] = (("admin", (SCOPE_CALL, SCOPE_ADMIN)),
                                                                              ("client", (SCOPE_CALL,)))) -> dict:
    """Write a private CA, a server certificate for ``hosts``, a client certificate (for mutual TLS),
    a tokens file and one token file per name into ``out_dir`` (files 0600). Returns {what: path}.

    For a first deployment and for tests; a real cluster may bring its own CA (cert-manager) instead."""
    import yaml
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def write(name: str, data: bytes) -> str:
        path = out / name
        tmp = path.with_suffix(path.suffix + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return str(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "prorag"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (x509.CertificateBuilder().subject_name(name("prorag CA")).issuer_name(name("prorag CA"))
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False, data_encipherment=False,
                                            key_agreement=False, encipher_only=False, decipher_only=False),
                              critical=True)
               .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, usage, sans: list) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca_cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), key_pem(key)

    sans = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    server_cert, server_key = leaf(hosts[0] if hosts else "prorag", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_cert, client_key = leaf("prorag client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    files = {
        "ca": write("ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM)),
        "ca_key": write("ca.key", key_pem(ca_key)),
        "server_cert": write("server.pem", server_cert), "server_key": write("server.key", server_key),
        "client_cert": write("client.pem", client_cert), "client_key": write("client.key", client_key),
    }
    entries = []
    for token_name, scopes in token_names:
        token = pysecrets.token_urlsafe(32)
        files[f"token_{token_name}"] = write(f"token-{token_name}", token.encode())
        entries.append({"name": token_name, "token_sha256": token_digest(token), "scopes": list(scopes)})
    files["tokens"] = write("tokens.yaml", yaml.safe_dump({"tokens": entries}, sort_keys=False).encode())
    return files
