"""Mixture of experts: the router protocol and the token dispatch (routing), and the
load-balancing of the whole step (balance)."""
