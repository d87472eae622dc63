"""``python -m transformer_engine`` is the ``te-fl`` command."""

from transformer_engine.cli import main

raise SystemExit(main())
