"""Persistence of search results: entries, the sqlite run archive, model selection."""
from archive.entry import ArchiveEntry, entry_id_for
from archive.select import combined_error, rank, recommend
from archive.store import ArchiveStore, RunDir, RunRecord, default_run_dir, locate_archive, record_latest

__all__ = [
    "ArchiveEntry",
    "ArchiveStore",
    "RunDir",
    "RunRecord",
    "combined_error",
    "default_run_dir",
    "entry_id_for",
    "locate_archive",
    "rank",
    "recommend",
    "record_latest",
]
