"""A table kept as Parquet part files, so a checkpoint writes only its new rows.

Rewriting a whole cache table at every checkpoint costs time that grows with the table (a million
shot rows, rewritten every few hundred shots, is hours). Here each checkpoint adds one part file,
written atomically; reading concatenates the parts, the folded file first and then the parts in
the order they were written; ``compact`` folds them into one file at the end of a run. A run
killed at any point leaves whole files only, though a kill inside ``compact`` can leave parts
that the folded file already holds: ``read(latest_by=...)`` keeps, for each key, only the rows of
the last file that has it, so those never count twice, and a part written later supersedes an
earlier one.
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from longlive_core.io.atomic import write_parquet


class PartTable:
    def __init__(self, directory: str | Path, stem: str, columns: list[str]):
        self.dir, self.stem, self.columns = Path(directory), stem, columns
        self._part = re.compile(re.escape(stem) + r"(-\d+)?\.parquet")

    def files(self) -> list[Path]:
        """The folded file first, then the parts in the order they were written."""
        found = [p for p in self.dir.glob(f"{self.stem}*.parquet") if self._part.fullmatch(p.name)]
        return sorted(found, key=lambda p: (p.name != f"{self.stem}.parquet", p.name))

    def read(self, latest_by: str | None = None) -> pd.DataFrame:
        frames = []
        for order, path in enumerate(self.files()):
            frame = pd.read_parquet(path)
            if len(frame):
                frames.append(frame.assign(_order=order))
        table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=[*self.columns, "_order"])
        if latest_by is not None and len(table):
            table = table[table["_order"] == table.groupby(latest_by)["_order"].transform("max")]
        # a table from before a column existed: those are empty
        return table.reindex(columns=self.columns).reset_index(drop=True)

    def append(self, rows: pd.DataFrame) -> None:
        if not len(rows):
            return
        numbers = [int(m.group(1)[1:]) for p in self.files() if (m := self._part.fullmatch(p.name)) and m.group(1)]
        name = f"{self.stem}-{max(numbers, default=-1) + 1:06d}.parquet"
        write_parquet(rows.reindex(columns=self.columns), self.dir / name)

    def compact(self, table: pd.DataFrame) -> None:
        """Replaces every part with ``table`` in one file (written before the parts go)."""
        old = self.files()
        write_parquet(table.reindex(columns=self.columns), self.dir / f"{self.stem}.parquet")
        for p in old:
            if p.name != f"{self.stem}.parquet":
                p.unlink()

    def clear(self) -> None:
        for p in self.files():
            p.unlink()
