"""Tessera: distributed training with a parameter server, peer all-reduce and federated learning.

This package is the small shared kernel: generated wire code (``tessera.v1``),
the tensor codec, gRPC options and the ``tessera`` command.
"""
__version__ = "0.1.0"
