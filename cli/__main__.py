"""``python -m kvpress_phase.cli``: the ``kvpress-phase`` command."""

from . import main

raise SystemExit(main())
