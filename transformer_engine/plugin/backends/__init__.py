"""In-tree backends: reference (pure PyTorch), flagos (Triton), vendor (e.g. cuda)."""
