"""Data: one loader for real (FlashRAG, wiki-18) and embedded (``prorag world``) datasets."""

from prorag.data.loaders import (Document, Question, SubStep, format_contents, iter_corpus, load_corpus,
                                 load_questions, load_split, parse_contents)

__all__ = ["Document", "Question", "SubStep", "format_contents", "iter_corpus", "load_corpus", "load_questions",
           "load_split", "parse_contents"]
