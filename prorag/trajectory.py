"""The one parser/renderer of ProRAG's step format; every service reads and writes trajectories here.

Layout (Qwen3 chat, empty think), exactly as the ProRAG code uses it::

    <|im_start|>system\\n{SYSTEM_PROMPT}<|im_end|>\\n<|im_start|>user\\n{question}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n<step>\\n                 <- prompt ends here
    {thought}</step>\\n<subquery>\\n{q}</subquery>                            <- generated (stop </subquery>)
    \\n<retrieval>\\n{docs}\\n</retrieval>\\n<step>\\n                          <- inserted by the environment
    {thought}</step>\\n<subanswer>\\n{a}</subanswer>                          <- generated
    \\n<step>\\n                                                             <- inserted
    {thought}</step>\\n<answer>\\n{ans}</answer>                              <- generated, final
    <|im_end|>                                                               <- inserted

A trajectory's text after the prompt is therefore ``"".join(render_step(s) for s in steps)``,
where a step's ``text`` is what the model generated and :func:`glue_after` what the
environment inserted after it. Parsing never raises: anything unparseable becomes an
``invalid`` step, and parsing stops there.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from prorag.data.loaders import Document

# --- tokens and glue -------------------------------------------------------------------------

STEP, STEP_END = "<step>", "</step>"
SUBQUERY, SUBQUERY_END = "<subquery>", "</subquery>"
RETRIEVAL, RETRIEVAL_END = "<retrieval>", "</retrieval>"
SUBANSWER, SUBANSWER_END = "<subanswer>", "</subanswer>"
ANSWER, ANSWER_END = "<answer>", "</answer>"

#: the 10 format tags; each is one special token of the policy's tokenizer
TAGS: tuple[str, ...] = (STEP, STEP_END, SUBQUERY, SUBQUERY_END, RETRIEVAL, RETRIEVAL_END,
                         SUBANSWER, SUBANSWER_END, ANSWER, ANSWER_END)
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
THINK, THINK_END = "<think>", "</think>"
#: chat special tokens (besides the tags) that the tokenizer keeps whole
CHAT_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, THINK, THINK_END)
#: generation of one step ends at any of these (all single tokens)
STOP_TAGS: tuple[str, ...] = (SUBQUERY_END, SUBANSWER_END, ANSWER_END, IM_END)

KINDS = ("subquery", "subanswer", "answer")
INVALID = "invalid"

EMPTY_THINK = f"{THINK}\n\n{THINK_END}\n\n"
#: what the prompt ends with: the model starts generating a step's thought right after it
STEP_OPEN = f"{STEP}\n"
#: inserted after a subanswer (and after the retrieval block): opens the next step
NEXT_STEP = f"\n{STEP_OPEN}"
RETRIEVAL_OPEN = f"\n{RETRIEVAL}\n"
RETRIEVAL_CLOSE = f"\n{RETRIEVAL_END}\n{STEP_OPEN}"
#: inserted after the final answer
FINAL = IM_END

# Kept short on purpose: every training sequence and rollout carries it, and on the CPU default
# its tokens are a noticeable share of compute. The format itself is taught by SFT. No tags
# appear in it: they are special tokens and would read as actions.
SYSTEM_PROMPT = (
    "Answer the question by searching step by step: in each step think, then search with a subquery, "
    "note the subanswer the documents give, or give the final answer."
)

DOC_TEMPLATE = "Doc {i}(Title: {title}) {text}"

#: ProRAG's format-aware SFT loss: per-token CE weights of tag tokens (all other tokens weigh 1)
FORMAT_LOSS_WEIGHTS: dict[str, float] = {
    ANSWER: 5.0, ANSWER_END: 5.0,
    SUBQUERY: 3.0, SUBQUERY_END: 3.0, SUBANSWER: 3.0, SUBANSWER_END: 3.0,
    STEP_END: 2.0,
}

#: ANCHORS: a valid trajectory's tag letters match (S Q R S A)* S F
FORMAT_REGEX = re.compile(r"(?:SQRSA)*SF")
TAG_LETTERS = {STEP: "S", SUBQUERY: "Q", RETRIEVAL: "R", SUBANSWER: "A", ANSWER: "F"}
_KIND_LETTER = {"subquery": "Q", "subanswer": "A", "answer": "F", INVALID: "X"}


#: any format tag or chat token: where a step's content ends, and what content may not hold
ANY_TAG = re.compile("|".join(re.escape(t) for t in TAGS + CHAT_TOKENS))


# --- data ------------------------------------------------------------------------------------

@dataclass
class Step:
    """One reasoning step.

    kind: "subquery" | "subanswer" | "answer" | "invalid".
    thought/content: stripped fields (content = the query, subanswer or answer).
    docs: the documents inserted after a subquery; None when no retrieval block followed it
      (parsed back from text they have no id, score or rank).
    text: exactly what the model generated for this step (thought through the closing tag);
      built from the fields when left empty.
    """

    kind: str
    thought: str = ""
    content: str = ""
    docs: list[Document] | None = None
    text: str = ""

    def __post_init__(self) -> None:
        if not self.text and self.kind in KINDS:
            self.text = f"{self.thought}{STEP_END}\n<{self.kind}>\n{self.content}</{self.kind}>"

    @property
    def valid(self) -> bool:
        return self.kind in KINDS

    @property
    def empty(self) -> bool:
        """Nothing to read: no text and no content beyond whitespace (an engine at the context limit returns no
        token; a sampled step can be blanks). A PRM has nothing to score in it."""
        return not (self.text.strip() or self.content.strip())


# --- rendering -------------------------------------------------------------------------------

def render_prompt(question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The prompt text; equals the tokenizer's chat template (enable_thinking=False) + ``<step>\\n``."""
    return (f"{IM_START}system\n{system_prompt}{IM_END}\n"
            f"{IM_START}user\n{question}{IM_END}\n"
            f"{IM_START}assistant\n{EMPTY_THINK}{STEP_OPEN}")


def _one_line(s: str) -> str:
    # one document per line (a newline would read as a new document), and no format tags:
    # a passage quoting "</retrieval>" or "<answer>" must not become a special token
    return " ".join(ANY_TAG.sub(" ", str(s)).split())


def as_doc(d: Document | Sequence[str] | Mapping) -> Document:
    """A Document from itself, a (title, text) pair or a mapping with title/text[/id/score]."""
    if isinstance(d, Document):
        return d
    if isinstance(d, Mapping):
        return Document.from_parts(str(d.get("id", "")), str(d.get("title", "")), str(d.get("text", "")),
                                   score=float(d.get("score", 0.0)))
    title, text = d
    return Document.from_parts("", str(title), str(text))


def clean_doc(d: Document | Sequence[str] | Mapping) -> Document:
    """The document as the policy sees it: title and text on one line, without tags.

    id, contents (the corpus string, as read), score and rank are kept.
    """
    d = as_doc(d)
    return dataclasses.replace(d, title=_one_line(d.title), text=_one_line(d.text))


def render_docs(docs: Iterable[Document | Sequence[str] | Mapping]) -> str:
    """``Doc {i}(Title: {title}) {text}`` one per line, i from 1 (whitespace collapsed to one line)."""
    return "\n".join(DOC_TEMPLATE.format(i=i, title=_one_line(d.title), text=_one_line(d.text))
                     for i, d in enumerate((as_doc(x) for x in docs), 1))


def retrieval_block(docs: Iterable[Document | Sequence[str] | Mapping]) -> str:
    """What the environment inserts after a subquery (opens the next step too)."""
    return f"{RETRIEVAL_OPEN}{render_docs(docs)}{RETRIEVAL_CLOSE}"


def glue_after(step: Step) -> str:
    """Text the environment inserts after ``step`` ("" after an invalid step, or a subquery not yet searched)."""
    if step.kind == "subquery":
        return "" if step.docs is None else retrieval_block(step.docs)
    if step.kind == "subanswer":
        return NEXT_STEP
    if step.kind == "answer":
        return FINAL
    return ""


def render_step(step: Step) -> str:
    """The generated text of ``step`` followed by the environment's insertion."""
    return step.text + glue_after(step)


def render_trajectory(question: str, steps: Iterable[Step], system_prompt: str = SYSTEM_PROMPT) -> str:
    return render_prompt(question, system_prompt) + "".join(render_step(s) for s in steps)


# --- parsing ---------------------------------------------------------------------------------

_STEP_RE = re.compile(
    rf"(?P<thought>.*?){re.escape(STEP_END)}\s*<(?P<kind>subquery|subanswer|answer)>(?P<content>.*?)"
    rf"</(?P=kind)>",
    re.DOTALL)
_STOP_RE = re.compile("|".join(re.escape(t) for t in STOP_TAGS))
_DOC_HEAD = re.compile(r"Doc (\d+)\(Title: ")


def parse_step(generated: str) -> Step:
    """Parse one generated step; never raises.

    Valid: ``{thought}</step>`` + ``<kind>`` + content + ``</kind>``, with no other tag in the
    thought or content and a non-blank content. Anything else is ``Step("invalid", text=generated)``.
    """
    if not isinstance(generated, str):
        return Step(INVALID, text="")
    m = _STEP_RE.fullmatch(generated)
    if m is None:
        return Step(INVALID, text=generated)
    thought, content = m.group("thought"), m.group("content")
    if ANY_TAG.search(thought) or ANY_TAG.search(content) or not content.strip():
        return Step(INVALID, text=generated)
    return Step(m.group("kind"), thought=thought.strip(), content=content.strip(), text=generated)


def _parse_doc_line(line: str) -> Document | None:
    m = _DOC_HEAD.match(line)
    if m is None:
        return None
    # the title ends at the ")" that balances "(Title: " (titles like "Foo (band)" keep their parens)
    depth, i = 0, m.end()
    while i < len(line):
        c = line[i]
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                break
            depth -= 1
        i += 1
    if i >= len(line):
        # unbalanced "(" in the title: fall back to the first ") "
        i = line.find(") ", m.end())
        if i < 0:
            return None
    title, text = line[m.end():i], line[i + 1:]
    return Document.from_parts("", title, text[1:] if text.startswith(" ") else text)


def parse_docs(block: str) -> list[Document]:
    """Inverse of :func:`render_docs` (lines that are not documents are skipped)."""
    out = []
    for line in block.split("\n"):
        d = _parse_doc_line(line)
        if d is not None:
            out.append(d)
    return out


def parse_trajectory(text: str) -> list[Step]:
    """Steps of a trajectory's text after the prompt (which ends with ``<step>\\n``); never raises.

    Each step runs to the first stop tag; its glue must follow exactly (or the text may end).
    The first invalid step, or any unexpected text between steps, ends the list with an
    ``invalid`` step holding the rest of the text.
    """
    if not isinstance(text, str):
        return []
    steps: list[Step] = []
    pos = 0
    while pos < len(text):
        m = _STOP_RE.search(text, pos)
        end = m.end() if m else len(text)
        step = parse_step(text[pos:end])
        steps.append(step)
        pos = end
        if not step.valid:
            break
        if step.kind == "answer":
            if text.startswith(FINAL, pos):
                pos += len(FINAL)
            if text[pos:].strip():
                steps.append(Step(INVALID, text=text[pos:]))
            break
        if step.kind == "subquery" and text.startswith(RETRIEVAL_OPEN, pos):
            close = text.find(RETRIEVAL_CLOSE, pos + len(RETRIEVAL_OPEN))
            if close < 0:
                # the block was cut (e.g. the context ran out): keep what parsed
                close_tag = text.find(RETRIEVAL_END, pos)
                block_end = close_tag if close_tag >= 0 else len(text)
                step.docs = parse_docs(text[pos + len(RETRIEVAL_OPEN):block_end])
                break
            step.docs = parse_docs(text[pos + len(RETRIEVAL_OPEN):close])
            pos = close + len(RETRIEVAL_CLOSE)
            continue
        if step.kind == "subanswer" and text.startswith(NEXT_STEP, pos):
            pos += len(NEXT_STEP)
            continue
        if pos < len(text):
            steps.append(Step(INVALID, text=text[pos:]))
        break
    return steps


# --- format checks and answers ---------------------------------------------------------------

def tag_sequence(steps_or_text: Sequence[Step] | str) -> str:
    """Letters of the format tags in order: S step, Q subquery, R retrieval, A subanswer, F answer.

    From steps: the prompt's ``<step>`` and each next one give S; an invalid step gives X.
    From text (a trajectory after the prompt): the opening tags found, with the prompt's S first.
    >>> tag_sequence([Step("subquery", "t", "q", docs=[]), Step("subanswer", "t", "a"), Step("answer", "t", "x")])
    'SQRSASF'
    """
    if isinstance(steps_or_text, str):
        letters = [TAG_LETTERS[t] for t in re.findall("|".join(map(re.escape, TAG_LETTERS)), steps_or_text)]
        return "S" + "".join(letters)
    out = []
    for s in steps_or_text:
        out.append("S" + _KIND_LETTER.get(s.kind, "X") + ("R" if s.kind == "subquery" and s.docs is not None else ""))
    return "".join(out)


def is_valid_format(steps_or_text: Sequence[Step] | str) -> bool:
    """ANCHORS' outcome format check: the tag letters fully match ``(S Q R S A)* S F``.

    >>> is_valid_format("x</step>\\n<answer>\\ny</answer><|im_end|>")
    True
    """
    if not isinstance(steps_or_text, str) and any(not s.valid for s in steps_or_text):
        return False
    return FORMAT_REGEX.fullmatch(tag_sequence(steps_or_text)) is not None


_ANSWER_RE = re.compile(rf"{re.escape(ANSWER)}(.*?){re.escape(ANSWER_END)}", re.DOTALL)


def extract_answer(text_or_steps: str | Sequence[Step]) -> str | None:
    """The final answer: the last answer step's content, else the last ``<answer>..</answer>`` in text; None if none."""
    if isinstance(text_or_steps, str):
        found = _ANSWER_RE.findall(text_or_steps)
        return found[-1].strip() if found else None
    for s in reversed(list(text_or_steps)):
        if s.kind == "answer":
            return s.content
    return None


def format_loss_weights(token_ids: Sequence[int], tag_token_ids: Mapping[str, int],
                        weights: Mapping[str, float] | None = None, default: float = 1.0) -> list[float]:
    """Per-token CE weights of ProRAG's format-aware loss.

    token_ids: [T] ids; tag_token_ids: tag string -> its token id (e.g. from the tokenizer);
    weights: tag -> weight (default :data:`FORMAT_LOSS_WEIGHTS`). Returns [T] floats.
    >>> format_loss_weights([7, 1, 2], {"<answer>": 1, "</step>": 2})
    [1.0, 5.0, 2.0]
    """
    table = FORMAT_LOSS_WEIGHTS if weights is None else weights
    by_id = {tag_token_ids[t]: float(w) for t, w in table.items() if t in tag_token_ids}
    return [by_id.get(int(t), float(default)) for t in token_ids]


__all__ = [
    "TAGS", "ANY_TAG", "STOP_TAGS", "CHAT_TOKENS", "KINDS", "INVALID", "SYSTEM_PROMPT", "EMPTY_THINK", "STEP_OPEN",
    "NEXT_STEP", "RETRIEVAL_OPEN", "RETRIEVAL_CLOSE", "FINAL", "FORMAT_LOSS_WEIGHTS", "FORMAT_REGEX",
    "Step", "as_doc", "clean_doc", "render_prompt", "render_docs", "retrieval_block", "glue_after", "render_step",
    "render_trajectory", "parse_step", "parse_docs", "parse_trajectory", "tag_sequence", "is_valid_format",
    "extract_answer", "format_loss_weights",
]
