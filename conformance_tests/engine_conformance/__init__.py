"""The conformance suite every engine plugin must pass."""
