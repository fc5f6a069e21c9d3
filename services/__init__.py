"""Service implementations (retriever, policy, PRM, judge, trainer)."""
