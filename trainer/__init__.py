"""cumulus trainer: the Hydra application that assembles a run and drives the engine."""
