"""ProRAG as services: the core package shared by every service (formats, metrics, data, clients)."""

__version__ = "0.1.0"
