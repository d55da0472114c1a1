"""Who may have written a store: its directories are ours, with modes we set.

A page that verifies is served, so whoever can write into the store can change another
user's outputs (a crafted page has a valid header and checksum), and whoever can read it
learns what was prompted. Stores are therefore private by default: directories 0700 and
files 0600, whatever the umask. ``store_mode = "group"`` makes them 2770/0660 for several
engine users in one group. At open, a directory owned by someone else, a symlink, or one
others could write into, is refused with the path, the owner and the fix. Our own
directories below the store root that an older version made readable (0755) are tightened
by removing the bits the mode does not grant (0755 -> 0700; a 0555 read-only tree stays
read-only as 0500), so a private namespace directory keeps every file below it private.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
from pathlib import Path

from hybridkv.core.errors import HybridKVError

log = logging.getLogger(__name__)
STORE_MODES = {"private": (0o700, 0o600), "group": (0o2770, 0o660)}


def existing_store_mode(root: Path) -> str:
    """The mode a store was made with, read from its root (the admin commands have no config)."""
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise HybridKVError(f"store directory {root} does not exist; check --store") from None
    return "group" if st.st_mode & 0o2070 == 0o2070 else "private"


def _user(uid: int) -> str:
    with contextlib.suppress(KeyError):
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    return f"uid {uid}"


class StoreDirs:
    """Creates and checks the directories of one store; remembers those already checked."""

    def __init__(self, root: Path, mode: str = "private"):
        if mode not in STORE_MODES:
            raise HybridKVError(f"store_mode {mode!r} is unknown; use private or group")
        self.root, self.mode = root, mode
        self.dir_mode, self.file_mode = STORE_MODES[mode]
        self._foreign_bits = 0o007 if mode == "group" else 0o077
        self._checked: set[Path] = set()
        self.tightened = 0

    def check(self, path: Path) -> None:
        """Refuse a directory another user (or anyone, through a symlink) controls."""
        if path in self._checked:
            return
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise HybridKVError(f"store path {path} is a symlink; point the store at a real directory")
        if not stat.S_ISDIR(st.st_mode):
            raise HybridKVError(f"store path {path} is not a directory; choose another store")
        me = os.geteuid()
        shared = self.mode == "group" and (st.st_gid == os.getegid() or st.st_gid in os.getgroups())
        if st.st_uid != me and not shared:
            raise HybridKVError(
                f"store directory {path} belongs to {_user(st.st_uid)}, not {_user(me)}: its pages "
                "could be that user's; use a store you own, or store_mode = \"group\" for a group store")
        loose = st.st_mode & (0o002 if self.mode == "group" else 0o022)
        if loose:
            fix = "2770" if self.mode == "group" else "700"
            raise HybridKVError(
                f"store directory {path} is writable by {'others' if self.mode == 'group' else 'group/others'} "
                f"(mode {stat.S_IMODE(st.st_mode):o}); run 'chmod {fix} {path}' or choose another store")
        old = stat.S_IMODE(st.st_mode)
        if st.st_uid == me and path != self.root and old & self._foreign_bits:
            self._tighten(path, old, old & ~self._foreign_bits)
        self._checked.add(path)

    def _tighten(self, path: Path, old: int, new: int) -> None:
        """Only below the root: the root may be a directory the user keeps other things in."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            os.fchmod(fd, new)
        except OSError:          # a read-only store: its modes stay, its pages are still checked
            return
        finally:
            os.close(fd)
        if not self.tightened:
            log.info("store %s: directories made by an older hybridkv set from mode %o to %o",
                     self.root, old, new)
        self.tightened += 1

    def ensure(self, path: Path) -> None:
        """Make ``path`` (and missing parents below an existing, checked one) with our mode."""
        if path in self._checked:
            return
        if not os.path.lexists(path):
            if not os.path.lexists(path.parent):
                self.ensure(path.parent)
            with contextlib.suppress(FileExistsError):     # another process made it first
                os.mkdir(path, self.dir_mode)
                os.chmod(path, self.dir_mode)              # the umask does not decide
        self.check(path)

    def create_file(self, path: Path, extra_flags: int = 0) -> int:
        """A new file that was not there before (no symlink followed), with our mode."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | extra_flags
        try:
            fd = os.open(path, flags, self.file_mode)
        except FileExistsError:                            # a crashed writer's leftover
            os.unlink(path)
            fd = os.open(path, flags, self.file_mode)
        os.fchmod(fd, self.file_mode)
        return fd
