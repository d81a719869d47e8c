"""The names of `moe.balance`'s modes, without torch: the config layer validates `moe.balance`
against them before any heavy import. Each is a strategy class in engine/moe/strategies.py
(tests/test_moe.py checks that the two lists agree)."""

BALANCE_MODES = ("global", "micro", "bias", "none", "seq_aux")
