"""Config and the command line: the schema, override checks, components built from
`_target_` nodes, user errors, the trust boundary for configs read from files."""
