"""`trainer.plan`: the real run simulated on fake tensors for a world of W GPUs, the
layout search, the GPUs' data."""
