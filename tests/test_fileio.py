"""Result files: atomic, readable as any file the user creates, and bad output paths refused up front."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dspark_cli.errors import DsparkError
from dspark_cli.fileio import (
    atomic_write_figure,
    atomic_write_json,
    check_figure_file,
    check_output_file,
    read_json,
)


def test_atomic_files_take_the_umask_like_any_other(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = atomic_write_json(tmp_path / "a.json", {"x": 1})
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o600)  # overwriting replaces the file: the new one takes the umask again
        atomic_write_json(path, {"x": 2})
        assert path.stat().st_mode & 0o777 == 0o644 and read_json(path) == {"x": 2}
    finally:
        os.umask(old)
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]  # no temporary file left


def test_a_figure_is_written_whole_in_the_format_its_suffix_names(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    png = atomic_write_figure(fig, tmp_path / "p.png")
    svg = atomic_write_figure(fig, tmp_path / "p.svg")
    plt.close(fig)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and b"<svg" in svg.read_bytes()[:400]


def test_output_paths_that_cannot_be_written_are_one_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(DsparkError, match="is a folder; name the file"):
        check_output_file(tmp_path, "--output")
    with pytest.raises(DsparkError, match="--output .*cannot write there"):
        check_output_file(afile / "x.json", "--output")
    assert check_output_file(tmp_path / "new" / "x.json", "--output") == tmp_path / "new" / "x.json"
    assert (tmp_path / "new").is_dir() and list((tmp_path / "new").iterdir()) == []
    with pytest.raises(DsparkError, match=r"--plot .*cannot write \.xyz"):
        check_figure_file(tmp_path / "r.xyz", "--plot")
    check_figure_file(tmp_path / "r.pdf", "--plot")


def test_a_link_is_written_through_and_a_special_file_is_refused(tmp_path: Path) -> None:
    # an atomic rename would put a regular file where the link or the FIFO was (as root, even over /dev/null)
    real = tmp_path / "real.json"
    real.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    atomic_write_json(link, {"a": 1})
    assert link.is_symlink() and read_json(real) == {"a": 1}
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for call in (lambda: atomic_write_json(fifo, {}), lambda: check_output_file(fifo, "-o")):
        with pytest.raises(DsparkError, match="is not a regular file"):
            call()
    assert not fifo.is_file()


def test_a_cut_last_line_is_dropped_however_long_and_whole_files_are_left_alone(tmp_path: Path) -> None:
    from dspark_cli.fileio import drop_cut_last_line

    p = tmp_path / "rows.jsonl"
    assert drop_cut_last_line(p) == 0  # missing
    p.write_bytes(b"")
    assert drop_cut_last_line(p) == 0
    p.write_bytes(b"a\nb\n")
    assert drop_cut_last_line(p) == 0 and p.read_bytes() == b"a\nb\n"
    fragment = b"x" * 200_000  # spans several of the backward search's blocks
    p.write_bytes(b"a\nb\n" + fragment)
    assert drop_cut_last_line(p) == len(fragment) and p.read_bytes() == b"a\nb\n"
    p.write_bytes(fragment)
    assert drop_cut_last_line(p) == len(fragment) and p.read_bytes() == b""
