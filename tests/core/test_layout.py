import json
import subprocess
import sys

import pytest

from hybridkv.config import load_layout
from hybridkv.core.errors import HybridKVError
from hybridkv.core.layout import layout_from_dict

from helpers import LAYOUTS


def test_shipped_layouts_round_trip():
    for path in LAYOUTS.glob("*.json"):
        layout = load_layout(path)
        again = layout_from_dict(json.loads(layout.to_json()))
        assert again == layout
        assert again.fingerprint() == layout.fingerprint()


def test_seed_layout_groups(seed_layout_dict):
    layout = layout_from_dict(seed_layout_dict)
    assert layout.block_tokens == 784
    kinds = [g.kind for g in layout.groups]
    assert kinds == ["attention", "scratch", "state", "state", "state", "state"]
    assert [g.id for g in layout.cacheable_groups] == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("mutate, fragment", [
    (lambda d: d["groups"][0].update(kind="mamba"), "groups[0].kind 'mamba' is unknown"),
    (lambda d: d["groups"][2].update(page_bytes=0), "groups[2].page_bytes must be a positive"),
    (lambda d: d["groups"][2].update(page_bytes=-5), "groups[2].page_bytes must be a positive"),
    (lambda d: d["groups"][3].update(id=2), "duplicate group id 2"),
    (lambda d: d["groups"][0].update(window_tokens=128), "only sliding_window groups have a window"),
    (lambda d: d["groups"].append({"id": 9, "kind": "sliding_window", "page_bytes": 8}),
     "groups[6].window_tokens must be a positive"),
    (lambda d: d.update(block_tokens="64"), "layout.block_tokens must be a positive integer"),
    (lambda d: d.update(groups=[]), "layout.groups must be a non-empty list"),
    (lambda d: d.pop("model"), "layout.model must be a non-empty string"),
    (lambda d: d["groups"][0].update(pages=3), "unknown field(s) ['pages']"),
])
def test_validation_errors_name_the_field(seed_layout_dict, mutate, fragment):
    mutate(seed_layout_dict)
    with pytest.raises(HybridKVError) as info:
        layout_from_dict(seed_layout_dict)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_malformed_json_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x", ')
    with pytest.raises(HybridKVError, match="not valid JSON"):
        load_layout(bad)


def test_fingerprint_is_stable_across_processes():
    path = LAYOUTS / "qwen3-next-80b-a3b.json"
    code = ("import sys; from hybridkv.config import load_layout; "
            "print(load_layout(sys.argv[1]).fingerprint())")
    prints = set()
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                             text=True, check=True, env={"PYTHONHASHSEED": seed, "PATH": ""})
        prints.add(out.stdout.strip())
    assert prints == {load_layout(path).fingerprint()}


@pytest.mark.parametrize("change", [
    lambda d: d.update(model="other"),
    lambda d: d.update(revision="abc"),
    lambda d: d.update(dtype="bfloat16"),
    lambda d: d.update(block_tokens=512),
    lambda d: d.update(tp_size=2, tp_rank=1),
    lambda d: d["groups"][2].update(page_bytes=7425001),
    lambda d: d["groups"][2].update(kind="attention"),
    lambda d: d["groups"][2].update(layers=["model.layers.1"]),
    lambda d: d["groups"][2].update(tensors=[{"name": "conv", "shape": [1, 2], "dtype": "f32"}]),
])
def test_fingerprint_changes_with_meaning(seed_layout_dict, change):
    before = layout_from_dict(seed_layout_dict).fingerprint()
    change(seed_layout_dict)
    assert layout_from_dict(seed_layout_dict).fingerprint() != before


def test_fingerprint_ignores_unrelated_extra_fields(seed_layout_dict):
    before = layout_from_dict(seed_layout_dict).fingerprint()
    seed_layout_dict["comment"] = "notes do not change the bytes"
    assert layout_from_dict(seed_layout_dict).fingerprint() == before


def test_engine_version_enters_the_fingerprint_and_round_trips():
    from hybridkv.core.layout import Group, Layout

    groups = (Group(0, "attention", 4096), Group(1, "state", 8192))
    plain = Layout("m", 16, groups)
    a, b = Layout("m", 16, groups, engine="vllm 0.32.0"), Layout("m", 16, groups, engine="vllm 0.33.0")
    assert len({plain.fingerprint(), a.fingerprint(), b.fingerprint()}) == 3
    assert layout_from_dict(a.to_dict()).fingerprint() == a.fingerprint()


def test_unreadable_or_binary_layout_files_are_one_line_errors(tmp_path):
    with pytest.raises(HybridKVError, match="cannot read layout file .*check the path"):
        load_layout(tmp_path / "missing.json")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00\x80garbage")
    with pytest.raises(HybridKVError, match="not (UTF-8 text|valid JSON)"):
        load_layout(binary)
