"""The step format: render -> parse round trips, garbage never raises, ANCHORS' format regex."""

import random

import pytest

from prorag import trajectory as T
from prorag.data.loaders import Document
from prorag.trajectory import Step


def two_hop() -> list[Step]:
    return [
        Step("subquery", "I need the director of Inception.", "Who directed Inception?",
             docs=[Document.from_parts("", "Inception", "Inception is a 2010 film directed by Christopher Nolan."),
                   Document.from_parts("", "Foo (band)", "A band; not (really) relevant.")]),
        Step("subanswer", "The document says who directed it.", "Christopher Nolan"),
        Step("subquery", "Now his birthplace.", "Where was Christopher Nolan born?",
             docs=[Document.from_parts("", "Christopher Nolan", "Nolan was born in London.")]),
        Step("subanswer", "Found it.", "London"),
        Step("answer", "So the answer is London.", "London"),
    ]


def test_prompt_layout():
    p = T.render_prompt("Who?")
    assert p.startswith("<|im_start|>system\n" + T.SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nWho?<|im_end|>\n")
    assert p.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<step>\n")


def test_step_text_is_exact_format():
    s = Step("subquery", "think", "q?")
    assert s.text == "think</step>\n<subquery>\nq?</subquery>"
    assert T.render_step(Step("subanswer", "t", "a")) == "t</step>\n<subanswer>\na</subanswer>\n<step>\n"
    assert T.render_step(Step("answer", "t", "x")) == "t</step>\n<answer>\nx</answer><|im_end|>"
    with_docs = Step("subquery", "t", "q", docs=[Document.from_parts("", "A", "aa"), ("B", "bb")])
    assert T.render_step(with_docs) == ("t</step>\n<subquery>\nq</subquery>\n<retrieval>\n"
                                        "Doc 1(Title: A) aa\nDoc 2(Title: B) bb\n</retrieval>\n<step>\n")


def test_round_trip_full_trajectory():
    steps = two_hop()
    text = T.render_trajectory("Where was the director of Inception born?", steps)
    prompt = T.render_prompt("Where was the director of Inception born?")
    parsed = T.parse_trajectory(text[len(prompt):])
    assert [(s.kind, s.thought, s.content) for s in parsed] == [(s.kind, s.thought, s.content) for s in steps]
    assert [[(d.title, d.text) for d in s.docs] if s.docs is not None else None for s in parsed] == \
           [[(d.title, d.text) for d in s.docs] if s.docs is not None else None for s in steps]
    assert "".join(T.render_step(s) for s in parsed) == text[len(prompt):]
    assert T.tag_sequence(parsed) == "SQRSASQRSASF" == T.tag_sequence(text[len(prompt):])
    assert T.is_valid_format(parsed) and T.is_valid_format(text[len(prompt):])
    assert T.extract_answer(parsed) == "London" == T.extract_answer(text)


def test_parse_step_kinds_and_whitespace():
    s = T.parse_step("  I think.  </step>\n<answer>\n  Paris </answer>")
    assert (s.kind, s.thought, s.content) == ("answer", "I think.", "Paris")
    assert T.parse_step("no closing").kind == "invalid"
    assert T.parse_step("t</step>\n<subquery>\n</subquery>").kind == "invalid"  # empty query
    assert T.parse_step("t<step></step>\n<subquery>\nq</subquery>").kind == "invalid"  # tag in thought
    assert T.parse_step("t</step>\n<subquery>\nq<answer></subquery>").kind == "invalid"
    assert T.parse_step("t</step>\n<subquery>\nq</subanswer>").kind == "invalid"  # mismatched closer
    assert T.parse_step("t</step>\n<answer>\nx</answer> trailing").kind == "invalid"
    assert T.parse_step("<|im_end|>").kind == "invalid"


def test_docs_render_one_line_and_no_tags():
    text = T.render_docs([Document.from_parts("", "T (x)", "line one\nline two </retrieval> <answer>")])
    assert text == "Doc 1(Title: T (x)) line one line two"
    assert [(d.title, d.text) for d in T.parse_docs(text)] == [("T (x)", "line one line two")]
    assert T.parse_docs("Doc 1(Title: unbalanced ( title) body") [0].text == "body"


@pytest.mark.parametrize("seq,ok", [
    ("SF", True), ("SQRSASF", True), ("SQRSASQRSASF", True),
    ("SQRSF", False), ("SASF", False), ("SQSASF", False), ("SQRSASQRSF", False), ("S", False), ("", False),
    ("SFSF", False), ("SQRSAS", False),
])
def test_format_regex(seq, ok):
    assert (T.FORMAT_REGEX.fullmatch(seq) is not None) is ok


def test_is_valid_format_cases():
    sq = Step("subquery", "t", "q", docs=[])
    sa, f = Step("subanswer", "t", "a"), Step("answer", "t", "x")
    assert T.is_valid_format([f])
    assert T.is_valid_format([sq, sa, f])
    assert not T.is_valid_format([sq, f])  # subquery must be followed by a subanswer
    assert not T.is_valid_format([Step("subquery", "t", "q"), sa, f])  # no retrieval block
    assert not T.is_valid_format([sq, sa])  # no final answer
    assert not T.is_valid_format([sq, sa, Step("invalid", text="zz"), f])
    assert not T.is_valid_format([])


def test_parse_trajectory_partial_and_trailing():
    # ends right after a subquery (not yet searched): docs None, tag S Q
    steps = T.parse_trajectory("t</step>\n<subquery>\nq</subquery>")
    assert [s.kind for s in steps] == ["subquery"] and steps[0].docs is None
    assert T.tag_sequence(steps) == "SQ"
    # retrieval block cut off by a context limit
    steps = T.parse_trajectory("t</step>\n<subquery>\nq</subquery>\n<retrieval>\nDoc 1(Title: A) aa\nDoc 2(Ti")
    assert steps[0].docs is not None and steps[0].docs[0].title == "A"
    # glue missing between steps: the rest becomes one invalid step
    steps = T.parse_trajectory("t</step>\n<subanswer>\na</subanswer>XX t</step>\n<answer>\nb</answer>")
    assert [s.kind for s in steps] == ["subanswer", "invalid"]
    # junk after the final answer
    steps = T.parse_trajectory("t</step>\n<answer>\nb</answer><|im_end|>more")
    assert [s.kind for s in steps] == ["answer", "invalid"]
    assert T.parse_trajectory("") == []


def test_garbage_never_raises():
    rng = random.Random(0)
    pieces = list(T.TAGS) + list(T.CHAT_TOKENS) + ["\n", " ", "a", "Doc 1(Title: ", ")", "x" * 5, "(", "é"]
    for _ in range(500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        steps = T.parse_trajectory(text)
        T.tag_sequence(steps), T.tag_sequence(text), T.is_valid_format(steps), T.extract_answer(steps)
        for s in steps:
            assert s.kind in T.KINDS + (T.INVALID,)
        T.parse_step(text)
    assert T.parse_step(None).kind == "invalid"  # type: ignore[arg-type]
    assert T.parse_trajectory(None) == []  # type: ignore[arg-type]


def test_extract_answer():
    assert T.extract_answer("a <answer>\n x </answer> b <answer>y</answer>") == "y"
    assert T.extract_answer("nothing") is None
    assert T.extract_answer([Step("subanswer", "t", "a")]) is None


def test_format_loss_weights():
    tag_ids = {t: i for i, t in enumerate(T.TAGS)}
    ids = [tag_ids["<answer>"], 99, tag_ids["</answer>"], tag_ids["<subquery>"], tag_ids["</subquery>"],
           tag_ids["<subanswer>"], tag_ids["</subanswer>"], tag_ids["</step>"], tag_ids["<step>"],
           tag_ids["<retrieval>"]]
    assert T.format_loss_weights(ids, tag_ids) == [5, 1, 5, 3, 3, 3, 3, 2, 1, 1]
    assert T.format_loss_weights(ids[:2], tag_ids, weights={"<answer>": 7.0}, default=0.5) == [7.0, 0.5]
    assert T.format_loss_weights([], tag_ids) == []


def test_doctests():
    import doctest

    assert doctest.testmod(T).failed == 0
