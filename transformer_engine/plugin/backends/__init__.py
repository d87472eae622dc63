"""In-tree backends: reference (pure PyTorch), flagos (Triton), vendor (e.g. cuda).

:mod:`transformer_engine.plugin.builtin` lists them, in load order, for the plugin core (which names none).
"""
