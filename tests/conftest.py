from __future__ import annotations

import logging

import pytest


@pytest.fixture(scope="session")
def default_lm():
    """The embedded default model (converted once by `make setup`)."""
    from cartridges.core.models import load_model

    return load_model(None, "cpu", "float32")  # mechanism tests compare against float32 references


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved as a local HF directory (exercises directory loading)."""
    from tests.tiny import tiny_llama

    lm = tiny_llama()
    path = tmp_path_factory.mktemp("tiny-llama")
    lm.model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


# Prefect's ephemeral server logs its shutdown at interpreter exit, after pytest has
# closed the captured streams; do not print a logging traceback for that.
logging.raiseExceptions = False


@pytest.fixture(autouse=True)
def _threads_kept():
    """A command run in-process sets torch's threads from the idle cores; the next test gets them back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    """Fault points count hits per process (`@n`); each test starts from zero."""
    monkeypatch.setattr("storage.faults._hits", {})


def pytest_sessionfinish(session, exitstatus):
    """Crash tests kill runs outright; stop the temporary Prefect servers they leave behind."""
    from flows.ephemeral import reap_orphans

    reap_orphans()
