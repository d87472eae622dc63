"""Framework-independent pieces: the FP8 recipes (:mod:`transformer_engine.common.recipe`) and the registry of
every environment variable the package reads (:mod:`transformer_engine.common.env`)."""

__all__ = ["env", "recipe"]
