"""Acme's Dovetail plugin: an example of everything a vendor can add through the contract."""
