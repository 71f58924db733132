"""Reading user files: special files refused before they are opened (a FIFO never blocks), reads
capped by kind, and ``.npz`` headers checked before any array is inflated."""

from __future__ import annotations

import io
import os
import threading
import zipfile

import numpy as np
import pytest

from tessera.core.errors import InputError
from tessera.core.user_files import read_npz, read_user_file, regular_file


def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/dev/zero", "a character device"), ("/dev/null", "a character device"), ("/", "a directory")],
)
def test_special_files_are_refused_by_kind(path, kind):
    with pytest.raises(InputError, match=f"expected a plan file; this is {kind}"):
        read_user_file(path, what="plan", limit=10)


def test_a_fifo_is_refused_without_blocking(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes; the reader must never open one."""
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            read_user_file(fifo, what="ONNX model", limit=10)
        except InputError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "the read blocked on a FIFO"
    assert "named pipe (FIFO)" in str(outcome[0]) and str(fifo) in str(outcome[0])
    with pytest.raises(InputError, match="named pipe"):
        regular_file(fifo, what="token")


def test_reads_are_capped_by_kind(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"1 2 3\n" * 100)
    assert read_user_file(path, what="prompts", limit=600) == b"1 2 3\n" * 100
    with pytest.raises(InputError, match="600 bytes, more than the 599 bytes a prompts file may hold"):
        read_user_file(path, what="prompts", limit=599)
    with pytest.raises(InputError, match="no such prompts file"):
        read_user_file(tmp_path / "absent", what="prompts", limit=10)


def test_an_npz_header_declaring_more_than_it_holds_is_refused_unread(tmp_path):
    """An 8 KB archive whose header declares 10^11 floats was allocated (373 GiB, MemoryError)."""
    path = tmp_path / "big.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", _npy_header("<f4", (10**11,)) + bytes(64))
    with pytest.raises(
        InputError, match=r"array 'x' declares shape \[100000000000\] \(400,000,000,000 bytes\)"
    ):
        read_npz(path)


def test_arrays_the_caller_does_not_want_are_never_inflated(tmp_path):
    """A compressed member that inflates to 400 MB the model never reads costs nothing: ``wanted``
    sees its header and skips it (a 3 MB archive inflating to 3 GB was read whole)."""
    path = tmp_path / "bomb.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("junk.npy", "w", force_zip64=True) as member:
            member.write(_npy_header("<f4", (100_000_000,)))
            for _ in range(40):
                member.write(bytes(10_000_000))
        archive.writestr("x.npy", _npy_header("<i8", (2, 3)) + np.arange(6, dtype="<i8").tobytes())
    assert path.stat().st_size < 2_000_000
    seen = []

    def wanted(name, dtype, shape):
        seen.append((name, str(dtype), shape))
        return name == "x"

    arrays = read_npz(path, wanted=wanted)
    assert seen == [("junk", "float32", (100_000_000,)), ("x", "int64", (2, 3))]
    assert list(arrays) == ["x"] and arrays["x"].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_the_check_refuses_before_reading(tmp_path):
    np.savez_compressed(tmp_path / "d.npz", x=np.ones((4, 3), np.float32), f=np.ones((2, 2), order="F"))

    def wanted(name, dtype, shape):
        if name == "x" and shape != (4, 5):
            raise InputError(f"array {name!r} has shape {list(shape)}, the model expects [4, 5]")
        return True

    with pytest.raises(InputError, match=r"has shape \[4, 3\], the model expects \[4, 5\]"):
        read_npz(tmp_path / "d.npz", wanted=wanted)
    got = read_npz(tmp_path / "d.npz")
    assert got["x"].shape == (4, 3) and got["f"].flags.f_contiguous and got["f"].sum() == 4


@pytest.mark.parametrize(
    "header",
    [b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,", b"(" * 40 + b"\n", b"{'descr': 'zz'}\n"],
    ids=["unterminated", "nested", "bad dtype"],
)
def test_a_broken_npy_header_is_input_error_in_an_npz_and_a_token_file(tmp_path, header: bytes) -> None:
    """numpy parses the header as a Python literal: a broken one raised tokenize's TokenError
    (exit 1) from ``--data`` and from a token file."""
    import struct

    from tessera.core.tokens import TokenWindows

    body = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + bytes(12)
    with zipfile.ZipFile(tmp_path / "d.npz", "w") as archive:
        archive.writestr("x.npy", body)
    (tmp_path / "t.npy").write_bytes(body)
    with pytest.raises(InputError, match=r"d\.npz: cannot read data"):
        read_npz(tmp_path / "d.npz")
    with pytest.raises(InputError, match=r"t\.npy: cannot read the token file"):
        TokenWindows(str(tmp_path / "t.npy"), 4, 100)
