"""How much of a file's mapping this process has mapped: the kernel's own count."""

from pathlib import Path


def mapped_bytes(path: str | Path) -> int:
    """The Rss of this process's mappings of ``path`` (/proc/self/smaps), in bytes."""
    name, total, inside = str(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):       # a mapping's header line
                inside = line.rstrip("\n").endswith(name)
            elif inside and first == "Rss:":
                total += int(line.split()[1]) * 1024
    return total
