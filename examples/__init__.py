"""Adapters of other people's trainers, proven by verify (each file is one adapter; see its docstring)."""
