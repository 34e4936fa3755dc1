"""A folder replaced as a unit (pytrain/formats/atomic.py ``replacing_folder``) is never lost,
even where the system cannot swap two folders in one rename and the writer is killed between
the two renames it needs instead."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from pytrain.formats.adapter_peft import read_peft_adapter, write_peft_adapter

ROOT = Path(__file__).resolve().parent.parent

# a PEFT adapter folder written over an earlier one, on a system without renameat2's exchange,
# by a process killed (os._exit: nothing of Python's clean-up runs) right after the first of
# the fallback's two renames, the old folder moved aside
CRASH = r"""
import os, sys
import numpy as np
from pytrain.formats import atomic
from pytrain.formats.adapter_peft import write_peft_adapter
atomic._exchange = lambda a, b: False
real = os.replace
def replace(a, b):
    real(a, b)
    if str(b).endswith(".old"):
        os._exit(9)
os.replace = replace
t = {"blk.1.attn_q.weight.lora_a": np.full((2, 64), 2.0, np.float32),
     "blk.1.attn_q.weight.lora_b": np.full((128, 2), 2.0, np.float32)}
write_peft_adapter(sys.argv[1], t, 8, 2, arch="qwen35")
"""


def tensors(value: float) -> dict:
    return {"blk.1.attn_q.weight.lora_a": np.full((2, 64), value, np.float32),
            "blk.1.attn_q.weight.lora_b": np.full((128, 2), value, np.float32)}


def test_a_folder_write_killed_between_its_renames_leaves_the_old_folder(tmp_path):
    """It left ``ad`` missing and the old adapter in an orphan ``.ad.HEX.old`` that nothing
    restored: the adapter was gone for every reader.  Now a reader (and the next write) puts
    the old folder back."""
    folder = tmp_path / "ad"
    write_peft_adapter(folder, tensors(1.0), 8, 2, arch="qwen35")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", CRASH, str(folder)], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 9, r.stderr
    assert not folder.exists() and len(list(tmp_path.glob(".ad.*.old"))) == 1   # the crash
    back, alpha, rank, _ = read_peft_adapter(folder, arch="qwen35")
    assert alpha == 8 and rank == 2
    for k, v in tensors(1.0).items():
        np.testing.assert_array_equal(back[k], v)
    assert not list(tmp_path.glob(".ad.*.old"))
    # and the next write replaces it as usual
    write_peft_adapter(folder, tensors(3.0), 8, 2, arch="qwen35")
    back, _, _, _ = read_peft_adapter(folder, arch="qwen35")
    np.testing.assert_array_equal(back["blk.1.attn_q.weight.lora_a"], tensors(3.0)[
        "blk.1.attn_q.weight.lora_a"])
    assert not list(tmp_path.glob(".ad.*.old"))


def test_a_write_killed_after_the_swap_leaves_no_old_folder(tmp_path):
    """The other half: killed after the new folder is in place but before the old one,
    moved aside, was deleted.  The new folder stays; the next reader deletes the old one."""
    folder = tmp_path / "ad"
    write_peft_adapter(folder, tensors(5.0), 8, 2, arch="qwen35")
    leftover = tmp_path / ".ad.0123abcd.old"
    leftover.mkdir()
    (leftover / "adapter_config.json").write_text("{}")
    back, _, _, _ = read_peft_adapter(folder, arch="qwen35")
    np.testing.assert_array_equal(back["blk.1.attn_q.weight.lora_a"],
                                  tensors(5.0)["blk.1.attn_q.weight.lora_a"])
    assert not leftover.exists()


def test_a_failed_write_names_the_file_it_was_for(tmp_path):
    """A full disk fails a write() or fsync() with an OSError that names no file ("[Errno 28]
    No space left on device"); a write into a folder being replaced names the temporary
    folder's file.  Both now name the file they were for; an error about another file keeps
    its own name; the earlier file or folder is intact."""
    import errno
    import pytest
    from pytrain.formats import atomic
    target = tmp_path / "a.bin"
    target.write_bytes(b"old")

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(OSError) as got:
        with atomic.replacing(target) as tmp:
            tmp.write_bytes(b"new")
            full()
    assert (got.value.errno, got.value.filename) == (errno.ENOSPC, str(target))
    assert target.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [target]
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "x").write_bytes(b"old")
    with pytest.raises(OSError) as got:
        with atomic.replacing_folder(folder) as tmp:
            open(tmp / "x", "wb").close()
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), str(tmp / "x"))
    assert (got.value.errno, got.value.filename) == (errno.EDQUOT, str(folder / "x"))
    assert (folder / "x").read_bytes() == b"old"
    with pytest.raises(FileNotFoundError) as got:
        with atomic.replacing(target):
            open(tmp_path / "missing")
    assert got.value.filename == str(tmp_path / "missing")
