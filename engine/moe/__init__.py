"""Mixture of experts: the router protocol and the token dispatch (routing), the experts'
grouped products (grouped), and the load-balancing of the whole step (balance)."""
