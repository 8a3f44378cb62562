"""Fixtures for the io tests: the real embedded tokenizer (loaded once; the model itself never is)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from conveyor.core.model_loader import ensure_embedded

    return AutoTokenizer.from_pretrained(ensure_embedded("smollm2-135m-instruct"))
