"""In-tree models, each a `model._target_` like any user's: the byte-level GPT and a small
CNN for images."""
