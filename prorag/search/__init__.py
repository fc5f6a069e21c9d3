"""Search for sibling steps and their labels: MCTS over the agent's steps (the pure selection and backup rules are
in prorag.algorithms.mcts), step pairs, and the judge's prompt and verdict parsing."""
