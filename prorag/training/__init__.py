"""Training machinery shared by every stage: checkpoints, the job context and the one training loop."""
