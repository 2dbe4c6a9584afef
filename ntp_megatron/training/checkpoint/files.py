"""Where checkpoints are on disk: ``iter_*`` directories, ``latest_checkpointed_iteration.txt`` and its atomic
replacement, a save's directory made ready, which checkpoint a path names (a root, one checkpoint directory, or
Megatron-LM's ``release`` layout), where a restarted job resumes, and whether a checkpoint's files are whole
(:func:`verify_checkpoint`, without reading a tensor).

May import: :mod:`.format`, and torch's DCP reader (for ``.metadata``); nothing that needs a process group or a
model, and not :mod:`.sharded`, :mod:`.load` or :mod:`.save`.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path
from typing import Optional

from torch.distributed.checkpoint import FileSystemReader

from ntp_megatron.training.checkpoint.format import RELEASE, CheckpointError


LATEST_FILE = "latest_checkpointed_iteration.txt"


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def _write_latest(root: Path, iteration: Optional[int]) -> None:
    """Point ``latest`` at ``iteration`` (None: remove it) atomically: readers see the old or the new file."""
    latest = root / LATEST_FILE
    if iteration is None:
        latest.unlink(missing_ok=True)
        return
    tmp = root / f".{LATEST_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, latest)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def _latest_entry(root: Path) -> Optional[str]:
    """What ``root``'s tracker file holds (stripped), None without one."""
    try:
        return (root / LATEST_FILE).read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _latest_iteration(root: Path) -> Optional[int]:
    entry = _latest_entry(root)
    return int(entry) if entry is not None and entry.isdigit() else None


def _complete_iterations(root: Path) -> list[int]:
    out = []
    for path in root.glob("iter_*"):
        if (path / "metadata.json").is_file() and path.name[5:].isdigit():
            out.append(int(path.name[5:]))
    return sorted(out)


def _prepare_dir(root: Path, iteration: int) -> Path:
    """An empty ``iter_*`` directory (rank 0). A leftover of the same iteration (a save killed midway, or a
    run that went further before this one resumed from an older checkpoint) is removed first; if ``latest``
    names it, ``latest`` first moves to the newest other complete checkpoint, so it never points at a
    directory being rewritten."""
    path = iteration_dir(root, iteration)
    root.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if _latest_iteration(root) == iteration:
            others = [i for i in _complete_iterations(root) if i != iteration]
            _write_latest(root, others[-1] if others else None)
        shutil.rmtree(path)
    path.mkdir()
    return path


def _is_checkpoint_name(name: str) -> bool:
    return name == RELEASE or (name.startswith("iter_") and name[5:].isdigit())


def restart_checkpoint(ck) -> Optional[Path]:
    """The one rule for where a restarted job resumes (every restart: NTP off, or ``ntp.on_unrecoverable: restart``):
    the run's own newest checkpoint (``checkpoint.save``), all of it, when it saved one; None: from
    ``checkpoint.load`` as the launcher pinned it at the start (or from the start). ``ck``: the config's
    ``checkpoint`` section."""
    return Path(ck.save) if ck.save and resolve_load_dir(Path(ck.save)) is not None else None


def resolve_load_dir(load: Path) -> Optional[Path]:
    """``load`` itself if it is one checkpoint (``metadata.json`` in it, or named ``iter_*`` or ``release``:
    complete or not, loading says which), else the one its ``latest_checkpointed_iteration.txt`` names (an
    iteration, or ``release`` as Megatron-LM's converters write); None if it names none."""
    if (load / "metadata.json").is_file() or _is_checkpoint_name(load.name):
        return load
    entry = _latest_entry(load)
    if entry == RELEASE:
        return load / RELEASE
    if entry is not None and entry.isdigit():
        return iteration_dir(load, int(entry))
    return None


def verify_checkpoint(path: Path) -> None:
    """That the checkpoint in ``path`` (an ``iter_*`` directory) is whole, without reading a tensor:
    ``metadata.json`` parses, ``common.pt`` is an intact archive (its records' CRCs), and under the torch_dist
    backend ``.metadata`` reads and every file it lists exists, can be opened, is as long as the items it holds
    there (a missing or truncated file is found by its length), and holds at each item's place what torch DCP
    writes there: a ``torch.save`` archive, which begins with a zip local header and ends with the end of its
    central directory (a file overwritten or swapped for another is found by two small reads per item).
    :class:`CheckpointError` naming the first file that is not. Run by the launcher before any rank starts
    (:func:`.load.read_progress`), and by a rank whose load failed, to name the file (:func:`.load._read_failure`)."""
    def broken(name: str, why: str) -> CheckpointError:
        return CheckpointError(f"checkpoint.load: {path.resolve() / name}: {why}")

    try:
        backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except FileNotFoundError:
        raise broken("metadata.json", "missing (not a complete checkpoint)") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise broken("metadata.json", f"unreadable ({type(exc).__name__}: {exc})") from None
    try:
        with zipfile.ZipFile(path / "common.pt") as archive:
            bad_record = archive.testzip()
    except FileNotFoundError:
        raise broken("common.pt", "missing") from None
    except (OSError, zipfile.BadZipFile, EOFError) as exc:
        raise broken("common.pt", f"unreadable or truncated ({type(exc).__name__}: {exc})") from None
    if bad_record is not None:
        raise broken("common.pt", f"corrupt (record {bad_record!r} fails its CRC check)")
    if backend != "torch_dist":
        return  # another backend's files: the load itself names what it cannot read
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except FileNotFoundError:
        raise broken(".metadata", "missing") from None
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign pickle fails in many ways
        raise broken(".metadata", f"unreadable ({type(exc).__name__}: {exc})") from None
    items: dict[str, list] = {}
    for item in (getattr(metadata, "storage_data", None) or {}).values():
        items.setdefault(item.relative_path, []).append(item)
    for name, held in sorted(items.items()):
        length = max(item.offset + item.length for item in held)
        try:
            with open(path / name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < length:
                    raise broken(name, f"truncated: {size} bytes, but the checkpoint's .metadata has data up to "
                                       f"byte {length}")
                for item in sorted(held, key=lambda item: item.offset):
                    if not item.transform_descriptors and not _is_archive(f, item.offset, item.length):
                        raise broken(name, f"corrupt: bytes {item.offset}..{item.offset + item.length} are not the "
                                           "archive the checkpoint's .metadata says is there")
        except FileNotFoundError:
            raise broken(name, "missing (the checkpoint's .metadata lists data in it)") from None
        except OSError as exc:
            raise broken(name, f"unreadable ({exc.strerror or type(exc).__name__})") from None


_ZIP_HEADER, _ZIP_END = b"PK\x03\x04", b"PK\x05\x06"
_ZIP_END_SIZE = 22
"""The end of central directory record: its signature and its size without a comment (torch.save writes none)."""


def _is_archive(f, offset: int, length: int) -> bool:
    if length < len(_ZIP_HEADER) + _ZIP_END_SIZE:
        return False
    f.seek(offset)
    head = f.read(len(_ZIP_HEADER))
    f.seek(offset + length - _ZIP_END_SIZE)
    return head == _ZIP_HEADER and f.read(len(_ZIP_END)) == _ZIP_END
