"""A training run's life: assembly, build, the fit loop, what a checkpoint holds, the batch
plan, auto micro-batch, the run directory's lock, evaluating a checkpoint."""
