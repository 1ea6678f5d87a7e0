"""Kernels and their plain-PyTorch references."""
