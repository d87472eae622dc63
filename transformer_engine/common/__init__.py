"""Framework-independent pieces: the FP8 recipes (:mod:`transformer_engine.common.recipe`)."""

__all__ = ["recipe"]
