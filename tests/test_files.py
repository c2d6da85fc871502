"""tfformer.files: a file is replaced whole or not at all, and a failed write leaves no temporary behind."""

import os

import pytest

from tfformer.files import write_atomic


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "notes.txt"
    assert write_atomic(str(path), "first") == str(path) and path.read_text() == "first"
    with pytest.raises(TypeError):
        write_atomic(str(path), 42)  # fails while writing
    (tmp_path / "folder").mkdir()
    with pytest.raises(OSError):
        write_atomic(str(tmp_path / "folder"), "text")  # fails at the move: a directory is in the way
    assert path.read_text() == "first" and sorted(os.listdir(tmp_path)) == ["folder", "notes.txt"]
    assert os.listdir(tmp_path / "folder") == []
