"""Persistence of search results: entries, the sqlite run archive, run directories, model selection."""

from archive.entry import ArchiveEntry, entry_id_for
from archive.rundir import RunDeployment, RunDir, default_run_dir, locate_archive, record_latest, run_deployments
from archive.select import combined_error, rank, recommend
from archive.store import ArchiveStore, RunRecord

__all__ = [
    "ArchiveEntry",
    "ArchiveStore",
    "RunDeployment",
    "RunDir",
    "RunRecord",
    "combined_error",
    "default_run_dir",
    "entry_id_for",
    "locate_archive",
    "rank",
    "recommend",
    "record_latest",
    "run_deployments",
]
