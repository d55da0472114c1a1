"""Child process for tier tests: writes or reads pages of a small layout through real tiers.

usage: tier_worker.py write STORE N [--storm] | read STORE N | region-create PATH | region-attach PATH
       | region-pin PATH LOG OTHERS
       | region-mapped PATH SLOTS PAGE
"""

import os
import sys
import time

import numpy as np

from hybridkv.cache import TieredCache, store_pages
from hybridkv.config import CacheConfig
from hybridkv.core.layout import layout_from_dict
from hybridkv.ram.regions import POPULATOR, SharedRegion
from hybridkv.tiers.filesystem import FilesystemTier

from helpers.smaps import mapped_bytes

LAYOUT = layout_from_dict({
    "model": "tier-test", "block_tokens": 16, "max_model_len": 4096,
    "groups": [{"id": 0, "kind": "attention", "page_bytes": 4096},
               {"id": 1, "kind": "state", "page_bytes": 16384}],
})


def page(group: int, i: int) -> np.ndarray:
    size = LAYOUT.group(group).page_bytes
    return np.random.default_rng(1000 * group + i).integers(0, 256, size, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def load_now(cache, wanted, request=None):
    """Pin ``wanted`` now, waiting for promotions: (the load, views of its pages), or
    (None, None) when a page could not be brought into RAM."""
    load = cache.prepare_load(wanted, request)
    views = None if load is None else cache.complete_load(load)
    return (load, views) if views is not None else (None, None)


def flip_payload_byte(store, group: int, key: bytes, layout=LAYOUT) -> None:
    """One flipped byte in a stored page's payload, wherever the store keeps it."""
    tier = FilesystemTier(store, layout)
    path, offset = tier.locate(group, key)
    tier.close()
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))


def written_tier(store, n=3, **kw) -> FilesystemTier:
    """A filesystem tier holding pages 0..n-1 of both groups."""
    tier = FilesystemTier(store, LAYOUT, **kw)
    for i in range(n):
        for g in (0, 1):
            assert tier.write(g, key(i), page(g, i))
    return tier


def _waiting_on(inode: int) -> int:
    """Processes blocked in flock on the file with this inode (/proc/locks' "->" lines)."""
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and line.split()[-3].split(":")[-1] == str(inode))


def main() -> None:
    cmd, target = sys.argv[1], sys.argv[2]
    if cmd.startswith("region-"):
        if cmd == "region-create":
            region = SharedRegion.create(target, 4, 4096)
            region.write(0, np.full(4096, 7, np.uint8))
        elif cmd == "region-pin":           # log the hook's start and end: do two overlap?
            log, others = sys.argv[3], int(sys.argv[4])
            region = SharedRegion.attach(target, 4, 4096)

            def hook(_region):
                with open(log, "a") as f:
                    f.write("start\n")
                # hold the lock until every process still to come waits on it (the kernel's
                # list of blocked flocks says so), or 10 s: a lock that excludes nothing
                # lets them start meanwhile
                inode, deadline = os.stat(target).st_ino, time.monotonic() + 10
                while time.monotonic() < deadline:
                    with open(log) as f:
                        done = f.read().split().count("end")
                    if _waiting_on(inode) >= others - done:
                        break
                    time.sleep(0.01)
                with open(log, "a") as f:
                    f.write("end\n")

            region.run_pin_hook(hook)
            region.close()
            return
        elif cmd == "region-mapped":        # attach: mapped before and after slot 0 is in use
            region = SharedRegion.attach(target, int(sys.argv[3]), int(sys.argv[4]))
            before = mapped_bytes(target)
            region.map_ahead(1)
            assert POPULATOR.wait(region, 60)
            print(before, mapped_bytes(target), int(region.array.sum()), flush=True)
            region.close()
            return
        else:
            region = SharedRegion.attach(target, 4, 4096)
            assert int(region.page(0)[0]) == 7
            region.write(1, np.full(4096, 9, np.uint8))
            region.close()
            return
        print("ready", flush=True)
        time.sleep(600)
        return
    n = int(sys.argv[3])
    config = CacheConfig(block_tokens=16, ram_bytes=64 * 1024**2, store=target)
    with TieredCache(LAYOUT, config) as cache:
        if cmd == "write":
            storm = "--storm" in sys.argv
            for i in range(n if not storm else 10**9):
                store_pages(cache, {0: [(key(i), page(0, i))], 1: [(key(i), page(1, i))]})
                cache.poll()
                if storm and i == 50:
                    print("storming", flush=True)
        else:
            ok = 0
            for i in range(n):
                load, views = load_now(cache, {0: [key(i)], 1: [key(i)]})
                if views is None:
                    continue
                assert np.array_equal(views[0][0], page(0, i)), i
                assert np.array_equal(views[1][0], page(1, i)), i
                cache.release(load)
                ok += 1
            print(f"restored {ok}")


if __name__ == "__main__":
    main()
