"""The inbox is sorted into /app/sorted by the date in each file name."""

from pathlib import Path

SORTED = Path("/app/sorted")
INBOX = Path("/app/inbox")

EXPECTED = {
    "2023/05/IMG_20230514_101500.jpg": "sunrise over the bay\n",
    "2023/05/IMG_20230514_120000.jpg": "lunch photo\n",
    "2022/11/scan-2022-11-03.pdf": "scanned letter\n",
    "2022/11/Report_2022-11-30.pdf": "monthly report\n",
    "2024/01/VID_20240101_000001.mp4": "new year video\n",
    "2023/01/budget 2023-01-15.xlsx": "budget sheet\n",
    "1999/12/invoice_19991231.pdf": "invoice 42\n",
    "undated/notes.txt": "loose notes\n",
    "undated/Meeting Notes.txt": "meeting notes\n",
    "undated/todo": "things to do\n",
    "undated/build-20231399.log": "build log\n",
}


def _files(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): p.read_text()
        for p in root.rglob("*")
        if p.is_file()
    }


def test_every_file_is_where_its_date_says() -> None:
    assert sorted(_files(SORTED)) == sorted(EXPECTED)


def test_contents_are_unchanged() -> None:
    assert _files(SORTED) == EXPECTED


def test_inbox_is_empty_but_kept() -> None:
    assert INBOX.is_dir()
    assert list(INBOX.iterdir()) == []
