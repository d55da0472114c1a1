"""Host registration of RAM regions, with the CUDA call replaced by a counting one: retries,
the fatal one-line error, and the unregistration before a region unmaps."""

import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.device.pinning import cuda_pin_hook
from hybridkv.ram.regions import SharedRegion


class FakeCuda:
    def __init__(self, failures: int, code: int = 1):
        self.failures, self.code = failures, code
        self.calls, self.registered, self.unregistered = 0, [], []

    def register(self, address: int, nbytes: int) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            return self.code
        self.registered.append((address, nbytes))
        return 0

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_a_transient_failure_is_retried_and_the_mapping_unregistered_at_close(tmp_path):
    cuda = FakeCuda(failures=2)
    hook = cuda_pin_hook(cuda.register, cuda.unregister, attempts=4, backoff_s=0)
    region = SharedRegion.create(tmp_path / "r", 4, 4096, hook)
    attached = SharedRegion.attach(tmp_path / "r", 4, 4096, hook, rank=1)   # a worker registers its own
    assert cuda.calls == 4 and [n for _, n in cuda.registered] == [16384, 16384]
    attached.close()
    region.close()
    assert sorted(cuda.unregistered) == sorted(a for a, _ in cuda.registered)


def test_a_final_failure_is_fatal_names_rank_region_and_fix_and_leaves_no_mapping(tmp_path):
    region = SharedRegion.create(tmp_path / "r", 4, 4096)
    cuda = FakeCuda(failures=99, code=1)
    with pytest.raises(HybridKVError) as err:
        SharedRegion.attach(tmp_path / "r", 4, 4096, cuda_pin_hook(cuda.register, cuda.unregister,
                                                                  attempts=3, backoff_s=0), rank=3)
    message = str(err.value)
    assert "\n" not in message and "rank 3" in message and str(tmp_path / "r") in message
    assert "failed 3 times (error codes [1, 1, 1])" in message and "ulimit -l" in message
    assert cuda.calls == 3 and not cuda.unregistered
    region.close()
    assert not (tmp_path / "r").exists()
