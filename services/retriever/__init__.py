"""Retriever service: encoders, index building and the retrieval engine."""
