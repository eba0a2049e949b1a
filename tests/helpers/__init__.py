"""Helpers shared by test modules (import them from here, not from another test module)."""
