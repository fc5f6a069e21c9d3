"""prorag.jsontext (issue 51): a string that is not Unicode text (a lone surrogate, from a JSON escape or from
surrogate bytes) is found with its JSON path, wherever JSON a caller wrote enters: HTTP bodies and config_json
(prorag.rpc.jsonbody), configs (prorag.config.from_dict, a job's mapping), the tokens file, the judge's replies."""

from __future__ import annotations

import json
import os

import pytest

from prorag.errors import InvalidArgument
from prorag.jsontext import MAY_HOLD_SURROGATES, check_strings, invalid_string


@pytest.mark.parametrize("value, path, fragment", [
    ("\ud800", "", "lone high surrogate U+D800 at character 0"),
    ("ab\udfff", "", "lone low surrogate U+DFFF at character 2"),
    ({"queries": ["ok", "x\udc00"]}, "queries[1]", "lone low surrogate U+DC00 at character 1"),
    ({"messages": [{"role": "user", "content": "hi"}, {}, {"role": "user", "content": "\udbff"}]},
     "messages[2].content", "U+DBFF"),
    ({"a": {"b": {"c\ud800": 1}}}, 'a.b["c\\ud800"] (a key)', "U+D800 at character 1"),
    ({"\udc80": "fine"}, '["\\udc80"] (a key)', "U+DC80"),
    ({"x-y": [[{"k": ("t", "\ud801")}]]}, '["x-y"][0][0].k[1]', "U+D801"),
    # UTF-8 bytes of a surrogate pair (CESU-8), as json's surrogatepass reads them: two lone surrogates, not one
    # astral character
    ('"\xed\xa0\xbd\xed\xb8\x80"'.encode("latin-1").decode("utf-8", "surrogatepass"), "", "U+D83D"),
])
def test_the_first_invalid_string_is_found_with_its_path(value, path, fragment):
    found = invalid_string(value)
    assert found is not None and found[0] == path, found
    assert fragment in found[1]
    with pytest.raises(InvalidArgument) as ei:
        check_strings(value, "request body")
    msg = str(ei.value)
    assert msg.startswith(f"request body: {path} " if path else "request body holds"), msg
    msg.encode("utf-8")  # the message itself is text: it can go into a gRPC status or a log


@pytest.mark.parametrize("value", [
    "", "plain", "\x00\u2028\ufffd\uffff", "\U0001f600", {"k": ["v", 1, 2.5, None, True, {"n": "\U0010ffff"}]},
    json.loads('"\\ud83d\\ude00"'),  # an escaped pair: json decodes it into one astral character
    json.loads('{"\\ud83d\\ude00": ["\\uD83D\\uDE00"]}'), 3, None, b"\xed\xa0\x80",  # bytes are not strings
])
def test_text_passes(value):
    assert invalid_string(value) is None
    assert check_strings(value) is value


def test_the_first_in_document_order_is_named_and_depth_does_not_matter():
    assert invalid_string({"a": "ok", "b\ud800": "\udc00", "c": "\udfff"})[0] == '["b\\ud800"] (a key)'
    assert invalid_string([["x"], ["y", "\ud800"], "\udc00"])[0] == "[1][1]"
    deep = "\ud800"
    for _ in range(20_000):  # deeper than the recursion limit: walked without recursion
        deep = [deep]
    assert invalid_string(deep)[0] == "[0]" * 20_000


def test_a_long_key_is_shortened_in_the_path():
    path, _ = invalid_string({"k" * 500 + "-": "\ud800"})
    assert path == '["' + "k" * 40 + '"...]' and len(path) < 60


def test_check_strings_raises_the_error_given():
    class Mine(Exception):
        pass

    with pytest.raises(Mine, match=r"the file: x\[0\] holds"):
        check_strings({"x": ["\ud800"]}, "the file", Mine)


def test_the_prefilter_sees_every_way_a_surrogate_can_arrive():
    for text in ('"\\ud800"', '"\\uDFFF"', '"\\uDbff\\uDc00"', '"\ud800"'):
        assert MAY_HOLD_SURROGATES.search(text), text
    for text in ('"\\u00e9"', '"\\uE000"', '"\\ud7ff"', '"plain \U0001f600"', '"\\\\"'):
        assert not MAY_HOLD_SURROGATES.search(text), text


# ---------------------------------------------------------------- where JSON enters
@pytest.mark.parametrize("data, path", [
    (b'{"queries": ["\\ud800"], "topk": 1}', "queries[0]"),  # the request, escaped
    ('{"queries": ["\ud800"]}'.encode("utf-8", "surrogatepass"), "queries[0]"),  # raw surrogate bytes
    ('{"messages": [{}, {}, {"content": "\udc00"}]}'.encode("utf-16-le", "surrogatepass"), "messages[2].content"),
    ('{"prompt": ["a", "\\udfff"]}', "prompt[1]"),  # str, as config_json arrives
    (b'{"\\ud800": 1}', '["\\ud800"] (a key)'),
])
def test_jsonbody_refuses_a_lone_surrogate_naming_its_path(data, path):
    from prorag.rpc.jsonbody import loads

    with pytest.raises(InvalidArgument) as ei:
        loads(data, "request body")
    assert str(ei.value).startswith(f"request body: {path} holds a lone"), str(ei.value)


def test_jsonbody_keeps_reading_what_it_read():
    from prorag.rpc.jsonbody import loads

    assert loads(b'{"q": "\\ud83d\\ude00 \\u00e9"}') == {"q": "\U0001f600 \u00e9"}
    assert loads('["\U0001f600"]'.encode("utf-16")) == ["\U0001f600"]  # UTF-16 with a BOM, as RFC 8259 allows
    assert loads(b'\xef\xbb\xbf{"a": 1}') == {"a": 1}  # a UTF-8 BOM, as json.loads(bytes) accepts
    with pytest.raises(InvalidArgument, match="not UTF-8 text"):
        loads(b'{"q": "\xff"}')
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        loads(b"{")


def test_a_config_mapping_with_a_lone_surrogate_is_a_config_error_naming_the_field():
    from prorag.config import ConfigError, from_dict
    from prorag.rpc.service import ServeConfig

    with pytest.raises(ConfigError) as ei:
        from_dict(ServeConfig, {"host": "local\udc00host"})
    assert ei.value.field == "host" and "lone low surrogate" in str(ei.value)


def test_a_tokens_file_with_a_lone_surrogate_is_refused_and_a_reload_keeps_the_old_tokens(tmp_path):
    from prorag.rpc.security import SecurityConfigError, TokenTable, parse_tokens

    with pytest.raises(SecurityConfigError, match=r"tokens.yaml: tokens\[0\]\.token holds a lone high surrogate"):
        parse_tokens({"tokens": [{"name": "a", "token": "\ud800" * 20}]}, "tokens.yaml")
    path = tmp_path / "tokens.yaml"
    good = "g" * 20
    path.write_text(f'tokens: [{{name: a, token: "{good}", scopes: [call]}}]\n')
    table = TokenTable(path, recheck_s=0)
    assert table.authenticate(f"Bearer {good}").name == "a"
    path.write_text('tokens: [{name: b, token: "\\ud800aaaaaaaaaaaaaaaaaaaa", scopes: [call]}]\n')  # a YAML escape
    os.utime(path, (1, 1))  # a changed modification time: re-read
    assert table.authenticate(f"Bearer {good}").name == "a"  # kept, not a crash
    path.write_bytes(b"tokens: [{name: c, token: \"\xff\xfe\"}]\n")  # not UTF-8 at all
    os.utime(path, (2, 2))
    assert table.authenticate(f"Bearer {good}").name == "a"
    with pytest.raises(SecurityConfigError):
        TokenTable(path)


def test_a_judge_reply_with_a_lone_surrogate_is_malformed_not_a_label():
    from prorag.search.judging import MalformedJudgeReply, parse_pair_reply

    with pytest.raises(MalformedJudgeReply, match="judge reply: reason holds a lone high surrogate") as ei:
        parse_pair_reply('Sure: {"chosen": 1, "reason": "step 2 \\ud800"}')
    str(ei.value).encode("utf-8")
    assert parse_pair_reply('{"chosen": 2, "reason": "\\ud83d\\ude00"}').reason == "\U0001f600"
