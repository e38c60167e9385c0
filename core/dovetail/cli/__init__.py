"""The ``dovetail`` command line."""
