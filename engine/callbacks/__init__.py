"""Callbacks: the hooks at the moments that matter to autograd (`base`), and the callbacks
cumulus ships: an EMA of the weights, per-layer gradient norms, the gradient noise scale."""

from engine.callbacks.base import AveragedWeights, Callback
from engine.step import CallbackList

__all__ = ["AveragedWeights", "Callback", "CallbackList"]
