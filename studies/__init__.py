"""The study scripts: the tables, decisions and simulations behind docs/results/, run from the repository's root as
``python -m studies.NAME`` (``targets``, ``dev_tables``, ``audit_tables``, ``study_tables``, ``calibration``). They
read finished runs through the installed package (:mod:`kvpress_phase.evaluation`) and are not part of it."""
