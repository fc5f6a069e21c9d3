"""The process reward model: building and loading it (model) and validating it on held-out corruption families
(evaluation). Its pure loss and scoring functions are in prorag.algorithms.prm."""
