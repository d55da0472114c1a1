"""Fixtures of the vLLM tests, which run in the vLLM virtual environment (``.venv-vllm``,
made by scripts/setup.sh); ``scripts/test.sh`` runs them after the main suite."""

import pytest

from hybridkv.integrations.vllm.tiny_models import save_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return lambda family: save_tiny_checkpoint(family, root / family)
