"""Shared fixtures. Nothing is downloaded: models are built from configs (see ``tiny_models.py``)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The kernel parity tests run the Triton kernels on the CPU through Triton's interpreter, which must be switched
# on before anything imports triton (transformers may). KVPRESS_PHASE_TEST_CUDA=1 runs them on a GPU instead.
if not os.environ.get("KVPRESS_PHASE_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402

from tiny_models import tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``second_model`` run only when the ``-m`` expression names that marker (``-m second_model``):
    the second real model costs a 478 MB fetch, two minutes of conversion and 2.5 GB of cache on first use, so a
    plain ``python -m pytest`` skips them."""
    if "second_model" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="opt-in: the second real model (qwen2.5-coder-0.5b); run with -m second_model")
    for item in items:
        if "second_model" in item.keywords:
            item.add_marker(skip)
