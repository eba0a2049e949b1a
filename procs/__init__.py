"""One module per OS process; each is a thin loop around logic in `relay`."""
