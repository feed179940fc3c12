"""Run-folder files: atomic writes (never half-written, whatever kills the process), JSON-lines logs that survive a
last line cut in half, and the lock that keeps two processes from writing one run folder."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from probcaps.errors import DataError, ProbcapsError

__all__ = ["OutputError", "RunFolderBusy", "atomic_write", "sweep_temporaries", "restored_on_failure", "write_json",
           "append_jsonl", "deferred_signals", "read_jsonl", "truncate_log", "RunLock"]

INTERRUPT_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# held back during a write as well: a closed terminal (SIGHUP) ends the program after the write, not inside it
_DEFERRED_SIGNALS = INTERRUPT_SIGNALS + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())


class OutputError(ProbcapsError, OSError):
    """A checkpoint, log or result could not be written (full disk, unwritable folder, a file where a folder should
    be).  Also an ``OSError``, so callers that catch those keep working."""


class RunFolderBusy(ProbcapsError):
    """Another process is training into the same run folder."""


def _output_error(path: Path, e: OSError) -> OutputError:
    reason = "no space left on the device" if e.errno == errno.ENOSPC else e.strerror or str(e)
    return OutputError(f"{path}: cannot write ({reason}); nothing was half-written")


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Hold back SIGINT and SIGTERM for the duration of the block, then deliver them (to the handlers that were
    in place before).  A Ctrl-C inside a zip writer or half-way through a rename then stops the program after the
    write instead of inside it.  Outside the main thread (where Python runs no signal handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in _DEFERRED_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for s in dict.fromkeys(received):  # each signal once, in arrival order
            signal.raise_signal(s)


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _writer_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # another user's live process
    return True


def sweep_temporaries(path: str | os.PathLike) -> None:
    """Remove the temporary files that writes of ``path`` killed before they could clean up (``kill -9``, a
    power cut) left beside it: ``.<name>.<pid>.<random>.tmp`` of a process that no longer runs."""
    path = Path(path)
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f"{glob_escape(_temp_prefix(path))}*.tmp"):
            pid = tmp.name[len(_temp_prefix(path)):].split(".", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _writer_alive(int(pid)):
                tmp.unlink(missing_ok=True)


def glob_escape(text: str) -> str:
    """``text`` with glob's special characters matched literally."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None], mode: str = "wb") -> Path:
    """Call ``write(fileobj)`` on a temporary file next to ``path``, fsync, then rename over ``path``.

    Signals are deferred meanwhile (:func:`deferred_signals`); an ``OSError`` (full disk, read-only or missing
    folder, a file where the folder should be) becomes a one-line :class:`OutputError` naming ``path``, with the
    old file, if any, intact and no temporary file left behind (whatever the exception).  The temporary file is
    ``.<name>.<pid>.<random>.tmp``: one that a ``kill -9`` leaves is removed by the next write of ``path``
    (:func:`sweep_temporaries`).
    """
    path = Path(path)
    with deferred_signals():
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            sweep_temporaries(path)
            fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=".tmp", dir=path.parent)
            with os.fdopen(fd, mode) as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            # mkstemp creates 0600 files; give the result the permissions an ordinary open() would
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
            os.replace(tmp, path)
        except BaseException as e:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            if isinstance(e, OSError) and not isinstance(e, OutputError):
                raise _output_error(path, e) from e
            raise
    return path


@contextlib.contextmanager
def restored_on_failure(path: str | os.PathLike) -> Iterator[None]:
    """Put ``path`` back as it was before the block (the old file, or no file) if the block raises: for files
    written together, such as a results JSON and the table made from it, where a failure of the second must not
    leave the first new.  The old file is kept as a hard link (no space needed) while the block runs."""
    path = Path(path)
    backup = None
    if path.is_file():
        backup = path.with_name(f"{_temp_prefix(path)}{os.getpid()}.{os.urandom(4).hex()}.tmp")
        try:
            os.link(path, backup)
        except OSError:
            backup = None  # a file system without hard links: a failure below removes the new file
    existed = path.exists()
    try:
        yield
    except BaseException:
        with deferred_signals(), contextlib.suppress(OSError):
            if backup is not None:
                os.replace(backup, path)
            elif not existed:
                path.unlink(missing_ok=True)
        raise
    finally:
        if backup is not None:
            with contextlib.suppress(OSError):
                backup.unlink(missing_ok=True)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` as indented JSON (with a trailing newline)."""
    return atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n"), mode="w")


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append one record as one line (one ``write`` call, signals deferred, so a Ctrl-C never cuts it; a kill -9
    can, and :func:`read_jsonl` drops such a last line)."""
    line = json.dumps(record) + "\n"
    with deferred_signals():
        try:
            with open(path, "a") as f:
                f.write(line)
        except OSError as e:
            raise _output_error(Path(path), e) from e


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JSON-lines log (``[]`` when the file does not exist).

    A damaged last line (a process killed while appending it) is dropped; a damaged line before the last is a
    one-line :class:`DataError` naming the file and the line.
    """
    path = Path(path)
    if not path.is_file():
        return []
    numbered = [(i + 1, line) for i, line in enumerate(path.read_text(errors="replace").split("\n")) if line.strip()]
    records = []
    for k, (number, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            if k == len(numbered) - 1:
                break  # cut by a kill in the middle of a write: that record never happened
            raise DataError(f"{path}, line {number}: not a JSON record ({e}); the log is damaged") from None
        records.append(record)
    return records


def truncate_log(path: str | os.PathLike, step: int) -> None:
    """Drop the records of a JSON-lines log past ``step`` (written after the checkpoint a run resumes from), and a
    damaged last line, so the log is one history.  Used for the training log and for any per-step evaluation log
    kept beside it."""
    if not Path(path).is_file():
        return
    keep = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    atomic_write(path, lambda f: f.write("".join(json.dumps(r) + "\n" for r in keep)), mode="w")


class RunLock:
    """An exclusive ``flock`` on ``FOLDER/.lock`` for the life of a run: a second process training into the same
    folder is refused in one line naming the folder and the holder's pid.  The kernel releases the lock when the
    holder exits, however it exits (kill -9 included), so a stale lock file never blocks a later run."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise _output_error(self.path, e) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(f"{self.folder}: another training run (pid {holder}) is writing this folder; wait "
                                f"for it to finish or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock; the file stays (unlinking it would race a waiting run)
            self._fd = None
