"""Wire plumbing: gRPC and HTTP servers, security (TLS, tokens), micro-batching, protobuf conversion, metrics and
logs, and the typed clients. Domain modules of the core never import it (tests/test_architecture.py); services and
the app do."""
