"""Wiring: `python -m launch.serve` starts and supervises Relay's processes."""
