"""The judge service."""
