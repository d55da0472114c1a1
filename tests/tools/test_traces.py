"""Trace files: both formats, the token ids Mooncake hash ids stand for, and every defect a
user's file can have (one line naming the line and the fix, exit 2)."""

import json

import numpy as np
import pytest

from hybridkv.core.errors import HybridKVError
from hybridkv.tools.traces import MAX_LINE_BYTES, read_trace, write_mooncake

from helpers.cli import assert_one_line_error, cli


def _write(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_mooncake_ids_share_tokens_exactly_as_far_as_the_ids_match(tmp_path):
    trace = _write(tmp_path / "t.jsonl",
                   {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
                   {"timestamp": 1, "input_length": 1200, "output_length": 5, "hash_ids": [7, 9, 10]},
                   {"timestamp": 2, "input_length": 512, "output_length": 5, "hash_ids": [8]})
    a, b, c = (r.tokens for r in read_trace(trace))
    assert [len(a), len(b), len(c)] == [1000, 1200, 512]
    assert (a[:512] == b[:512]).all() and (a[512:1000] != b[512:1000]).mean() > 0.99
    assert (a[512:1000] == c[:488]).all()            # id 8 means the same tokens anywhere
    assert a.dtype == np.int64 and a.min() >= 0


def test_tokens_format_keeps_sessions(tmp_path):
    trace = _write(tmp_path / "t.jsonl", {"prompt_ids": [1, 2, 3], "session": "u1"}, "", {"prompt_ids": [4]})
    first, second = read_trace(trace, "tokens")
    assert first.tokens.tolist() == [1, 2, 3] and first.session == "u1"
    assert second.tokens.tolist() == [4] and second.session is None


def test_write_mooncake_round_trips(tmp_path):
    path = tmp_path / "gen.jsonl"
    assert write_mooncake(path, [([1, 2], 7), ([1, 3], 5)], 4) == 2
    assert [len(r.tokens) for r in read_trace(path, block_tokens=4)] == [7, 5]


@pytest.mark.parametrize("records, fmt, fragment", [
    ([{"timestamp": 0, "input_length": 10, "output_length": 1}], "mooncake", "'hash_ids' is missing"),
    ([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, "x"]}], "mooncake",
     "list of non-negative integers"),
    ([{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1.5]}], "mooncake",
     "list of non-negative integers"),
    ([{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}], "mooncake",
     "does not fit 1 hash ids"),
    (["{not json"], "mooncake", "line 1: not JSON"),
    (["[1, 2]"], "tokens", "a list, not an object"),
    ([{"prompt": "hi"}], "tokens", "'prompt_ids' is missing"),
    ([{"prompt_ids": []}], "tokens", "'prompt_ids' is empty"),
])
def test_bad_lines_are_one_line_errors(tmp_path, records, fmt, fragment):
    trace = _write(tmp_path / "bad.jsonl", *records)
    with pytest.raises(HybridKVError, match="line 1"):
        read_trace(trace, fmt)
    assert_one_line_error(cli("simulate", "--trace", trace, "--trace-format", fmt), fragment)


def test_empty_missing_and_huge_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert_one_line_error(cli("simulate", "--trace", empty), "is empty")
    assert_one_line_error(cli("simulate", "--trace", tmp_path / "absent.jsonl"), "cannot open")
    huge = tmp_path / "huge.jsonl"
    huge.write_bytes(b'{"prompt_ids": [' + b"1, " * (MAX_LINE_BYTES // 3 + 1) + b"1]}\n")
    assert_one_line_error(cli("simulate", "--trace", huge, "--trace-format", "tokens"), "longer than 16 MiB")
    assert huge.stat().st_size > MAX_LINE_BYTES           # the user's file is left as it was
