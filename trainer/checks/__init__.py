"""Runs checked against each other: `trainer.compare` (two runs' records) and
`trainer.certify` (one configuration under every layout)."""
