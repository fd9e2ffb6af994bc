"""Slapo: a schedule language for training large PyTorch models."""

__version__ = "0.1.0"
