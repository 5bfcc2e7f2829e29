"""Shared fixtures. Nothing is downloaded: models are built from configs (see ``tiny_models.py``)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from tiny_models import tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()
