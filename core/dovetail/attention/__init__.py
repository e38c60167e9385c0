"""Attention: the backend contract, the step batch, and the core's backends."""
