"""The registry of TE-FL's environment variables, and how configuration mistakes are reported.

The declarations and readers live in the bottom layer, :mod:`transformer_engine.common.env` (pure
Python, so that :mod:`transformer_engine.common.recipe` reads its ``NVTE_*`` defaults through them too);
this module re-exports them under their plugin names, the same objects. :data:`VARIABLES` here is the
plugin's part of the registry: every ``TE_FL_*`` variable (name, one-line meaning, default, deprecated
aliases), read through :func:`lookup` / :func:`read`, which refuse a name that is not declared. Values
are validated by :mod:`.config`.

Mistakes are named, never silent:

- a variable of the ``TE_FL_`` / ``TEFL_`` namespace that is not declared warns, naming the closest
  declared one (``TE_FL_STRCT`` -> ``TE_FL_STRICT``);
- a deprecated alias (``TEFL_LOG_LEVEL``) still works and warns, naming its replacement;
- every such warning (:func:`config_warning`) is issued once per process, attributed to the first
  frame outside TE-FL, torch and importlib (the user's code), or to ``<environment>`` when there is none.

``TE_FL_LOG_LEVEL`` (:func:`configure_logging`) sets the level of the ``transformer_engine.plugin``
logger and, if no handler would otherwise print its records, gives it one on stderr. Nothing here
touches logging unless that variable is set.
"""

from __future__ import annotations

import logging
import sys

from transformer_engine.common.env import (
    NAMESPACES,
    EnvVar,
    PolicyConfigWarning,
    check_environment,
    closest,
    closest_name,
    config_warning,
    describe,
    lookup,
    read,
    reset_warnings,
)
from transformer_engine.common.env import OWN_VARIABLES as VARIABLES

__all__ = [
    "EnvVar",
    "PolicyConfigWarning",
    "VARIABLES",
    "NAMESPACES",
    "LOGGER_NAME",
    "lookup",
    "read",
    "closest",
    "closest_name",
    "check_environment",
    "config_warning",
    "configure_logging",
    "describe",
    "reset_warnings",
]

LOGGER_NAME = "transformer_engine.plugin"


# -- logging ----------------------------------------------------------------------------------------
class _Handler(logging.StreamHandler):
    """The stderr handler TE-FL adds to its logger when ``TE_FL_LOG_LEVEL`` is set and nothing else prints."""


def configure_logging(level: int) -> logging.Logger:
    """Set the TE-FL logger's level; give it a stderr handler if its records would otherwise be lost.

    Called only when ``TE_FL_LOG_LEVEL`` (or its alias) is set. A handler is added only when neither
    the logger nor an ancestor has one (``logging.lastResort`` would print WARNING and above only);
    an application that configured logging keeps its own handlers and no record is printed twice.
    """
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not logger.hasHandlers():
        handler = _Handler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return logger
