"""Upstream contract tests: the facts the project relies on, read from each release's wheel (`pytest -m contract`)."""
