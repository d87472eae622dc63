"""TransformerEngine-FL: FP8 Transformer building blocks in pure Python + Triton.

Import the framework you use::

    import transformer_engine.pytorch as te      # PyTorch modules, autocast, recipes
    import transformer_engine.jax as te_jax      # JAX / Flax (optional extra)

Importing this package imports no framework and changes no global state.
"""

from importlib import metadata as _metadata

__all__ = ["__version__"]

try:
    __version__ = _metadata.version("transformer_engine")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "2.9.0+fl"
