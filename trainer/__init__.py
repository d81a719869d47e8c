"""cumulus trainer: the Hydra application that assembles a run and drives the engine."""

from engine.dependency_noise import silence_dependency_noise

# Before any command imports transformers (and, through it, torchao): every command and
# trainer.api pass through this package.
silence_dependency_noise()
