"""Dovetail's CPU plugin."""
