"""Vendor backends (vendor libraries reached through PyTorch)."""
