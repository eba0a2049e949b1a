"""Relay's own kernels: C for CPUs (`cpu`), built for the machine they run on."""
