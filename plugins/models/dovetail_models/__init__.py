"""Dovetail's model zoo."""
