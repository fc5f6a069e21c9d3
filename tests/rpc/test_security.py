"""The pure parts of prorag.rpc.security: scopes per method, the tokens file, settings that cannot work."""

import os
import time

import pytest

from prorag.rpc.security import (ClientSecurity, SecurityConfigError, ServerSecurity, TokenTable, generate_secrets,
                             parse_tokens, required_scope, token_digest)

TOKEN = "t" * 32


def test_scopes_of_methods():
    assert required_scope("/grpc.health.v1.Health/Check") is None
    assert required_scope("/grpc.health.v1.Health/Watch") is None
    assert required_scope("/prorag.v1.Trainer/ListJobs") == "admin"
    assert required_scope("/prorag.v1.Policy/ActivateAdapter") == "admin"
    assert required_scope("/prorag.v1.Policy/ListAdapters") == "call"
    assert required_scope("/prorag.v1.Policy/GenerateSteps") == "call"
    assert required_scope("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") == "call"


def test_tokens_file_plain_and_hashed():
    table = parse_tokens({"tokens": [{"name": "a", "token": TOKEN, "scopes": ["call", "admin"]},
                                     {"name": "b", "token_sha256": token_digest("u" * 20)}]})
    assert table[token_digest(TOKEN)].scopes == {"call", "admin"}
    assert table[token_digest("u" * 20)].scopes == {"call"}  # call is the default scope


@pytest.mark.parametrize("data, words", [
    ({}, "list under 'tokens'"),
    ({"tokens": []}, "no tokens"),
    ({"tokens": [{"token": "short"}]}, "at least 16"),
    ({"tokens": [{"token": TOKEN, "token_sha256": "0" * 64}]}, "exactly one"),
    ({"tokens": [{"token_sha256": "xyz"}]}, "64 hex"),
    ({"tokens": [{"token": TOKEN, "scopes": ["root"]}]}, "scopes must be"),
    ({"tokens": [{"token": TOKEN, "role": "x"}]}, "unknown key"),
    ({"tokens": [{"token": TOKEN}, {"token": TOKEN}]}, "twice"),
])
def test_bad_tokens_files_say_what_is_wrong(data, words):
    with pytest.raises(SecurityConfigError, match=words):
        parse_tokens(data)


def test_token_table_authenticates_and_follows_changes(tmp_path):
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens: [{{name: a, token: {TOKEN}, scopes: [call]}}]\n")
    table = TokenTable(path, recheck_s=0)
    assert table.authenticate(f"Bearer {TOKEN}").name == "a"
    assert table.authenticate(f"bearer {TOKEN}").name == "a"
    for bad in (None, "", TOKEN, f"Basic {TOKEN}", "Bearer ", f"Bearer {TOKEN}x"):
        assert table.authenticate(bad) is None, bad
    # Rotation: a new file replaces the old tokens ...
    path.write_text(f"tokens: [{{name: b, token: {'n' * 20}, scopes: [call, admin]}}]\n")
    os.utime(path, (time.time() + 5, time.time() + 5))
    assert table.authenticate(f"Bearer {TOKEN}") is None
    assert table.authenticate(f"Bearer {'n' * 20}").name == "b"
    # ... but a broken file keeps the tokens read before (a half-written Secret must not lock everyone out).
    path.write_text("tokens: [")
    os.utime(path, (time.time() + 10, time.time() + 10))
    assert table.authenticate(f"Bearer {'n' * 20}").name == "b"


def test_settings_that_cannot_work_are_refused():
    with pytest.raises(SecurityConfigError, match="both a certificate and its key"):
        ServerSecurity(tls_cert="cert.pem")
    with pytest.raises(SecurityConfigError, match="needs server TLS"):
        ServerSecurity(tls_client_ca="ca.pem")
    with pytest.raises(SecurityConfigError, match="cannot read the tokens file"):
        ServerSecurity(auth_tokens="/nonexistent/tokens.yaml").tokens()
    with pytest.raises(SecurityConfigError, match="not PEM"):
        ServerSecurity(tls_cert=__file__, tls_key=__file__).grpc_credentials()


def test_settings_come_from_the_environment(tmp_path):
    (tmp_path / "tok").write_text(TOKEN + "\n")
    sec = ClientSecurity.from_env({"PRORAG_TOKEN": "ignored", "PRORAG_TOKEN_FILE": str(tmp_path / "tok"),
                                   "PRORAG_TLS_CA": "ca.pem"})
    assert sec.token == TOKEN and sec.tls and sec.authorization() == f"Bearer {TOKEN}"
    assert not ClientSecurity.from_env({}).tls and ClientSecurity.from_env({}).authorization() is None
    with pytest.raises(SecurityConfigError, match="PRORAG_TOKEN_FILE"):
        ClientSecurity.from_env({"PRORAG_TOKEN_FILE": str(tmp_path / "missing")})
    srv = ServerSecurity.from_env({"PRORAG_TLS_CERT": "c", "PRORAG_TLS_KEY": "k", "PRORAG_AUTH_TOKENS": "t"})
    assert srv.tls and srv.describe() == "TLS, bearer tokens"


def test_generated_secrets_hold_only_hashes_of_tokens(tmp_path):
    files = generate_secrets(tmp_path)
    table = TokenTable(files["tokens"])
    admin = open(files["token_admin"]).read()
    assert admin not in open(files["tokens"]).read()
    assert table.authenticate(f"Bearer {admin}").scopes == {"call", "admin"}
    assert table.authenticate(f"Bearer {open(files['token_client']).read()}").scopes == {"call"}
    assert oct(os.stat(files["server_key"]).st_mode & 0o777) == "0o600"
    ServerSecurity(tls_cert=files["server_cert"], tls_key=files["server_key"],
                   tls_client_ca=files["ca"]).ssl_context()  # loads: the pair matches
