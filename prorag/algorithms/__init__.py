"""Pure algorithm functions (losses, schedules; later rewards, advantages, MCTS, filters): tensors and numbers
in, tensors and numbers out, no I/O, shapes in docstrings. Selected by name from configuration."""
