import subprocess
import sys

import numpy as np

from hybridkv.core.keys import block_hashes


def test_chaining_makes_keys_depend_on_the_whole_prefix():
    a = list(range(256))
    b = [999] + a[1:]
    ha, hb = block_hashes(a, 64), block_hashes(b, 64)
    assert len(ha) == 4
    assert all(x != y for x, y in zip(ha, hb, strict=True))  # block 0 changed -> every key changes
    c = a[:128] + [7] * 128
    hc = block_hashes(c, 64)
    assert hc[:2] == ha[:2] and hc[2] != ha[2] and hc[3] != ha[3]


def test_ragged_tail_has_no_key_and_prefix_keys_are_shared():
    tokens = list(range(200))
    assert len(block_hashes(tokens, 64)) == 3
    assert block_hashes(tokens[:128], 64) == block_hashes(tokens, 64)[:2]


def test_salt_and_extra_isolate():
    tokens = list(range(128))
    plain = block_hashes(tokens, 64)
    assert block_hashes(tokens, 64, salt="tenant-a") != plain
    assert block_hashes(tokens, 64, salt="tenant-a") != block_hashes(tokens, 64, salt="tenant-b")
    assert block_hashes(tokens, 64, salt="tenant-a") == block_hashes(tokens, 64, salt=b"tenant-a")
    assert block_hashes(tokens, 64, extra=b"lora-1") != plain


def test_deterministic_across_processes_and_hash_seeds():
    code = ("from hybridkv.core.keys import block_hashes; "
            "print(block_hashes(list(range(1000)), 64, salt='s')[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
            for seed in ("1", "2", "random")}
    assert outs == {block_hashes(list(range(1000)), 64, salt="s")[-1].hex()}


def test_list_and_array_inputs_agree():
    tokens = np.arange(4096, dtype=np.int32)
    assert block_hashes(tokens, 64) == block_hashes(tokens.tolist(), 64)


def test_64k_prompt_gives_one_distinct_key_per_block():
    # the speed is a benchmark figure (`hybridkv bench`), not a test assertion
    tokens = np.random.default_rng(0).integers(0, 150000, 65536)
    keys = block_hashes(tokens, 16)
    assert len(keys) == 4096 and len(set(keys)) == 4096


def test_a_chain_keyed_in_parts_is_the_chain_keyed_at_once():
    """What lets a prompt be looked up a part at a time while the rest is still keyed."""
    tokens = list(range(640))
    whole = block_hashes(tokens, 64, salt="s", extra=b"x")
    first = block_hashes(tokens[:192], 64, salt="s", extra=b"x")
    assert first + block_hashes(tokens[192:], 64, salt="s", extra=b"x", after=first[-1]) == whole
    assert block_hashes(tokens[192:], 64, salt="s", extra=b"x") != whole[3:]
