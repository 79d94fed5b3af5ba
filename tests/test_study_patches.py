"""benchmarks/patches/: the what-if patches behind figures in docs/RESULTS.md still apply,
to the pinned BLIS (``../shared/blis``) and to this checkout, so that the commands given
there reproduce them. ``git apply --check`` reads and writes nothing else."""

import shutil
import subprocess
from pathlib import Path

import pytest

from primitives.data.roots import shared_data_root

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "benchmarks" / "patches"
BLIS_SRC = shared_data_root() / "blis"


def _applies(patch: Path, tree: Path) -> subprocess.CompletedProcess:
    git = shutil.which("git")
    if git is None:
        pytest.skip("no git on this machine")
    # outside a repository git apply works on plain files, as patch(1) does
    return subprocess.run([git, "apply", "--check", str(patch)], cwd=tree, capture_output=True, text=True)


BLIS_PATCHES = [
    "blis_keep_generated_tokens.patch",
    "blis_vllm_preemption.patch",
    "blis_share_group_system_prompt.patch",
]
PROJECT_PATCHES = ["project_free_finished_at_once.patch", "project_no_group_system_prompt.patch"]


@pytest.mark.parametrize("name", BLIS_PATCHES)
def test_blis_patches_apply_to_the_pinned_blis(name):
    if not BLIS_SRC.is_dir():
        pytest.skip(f"no BLIS checkout at {BLIS_SRC} (set STEPSYNTH_SHARED to the shared/ folder)")
    res = _applies(PATCHES / name, BLIS_SRC)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("name", PROJECT_PATCHES)
def test_project_patches_apply_to_this_checkout(name):
    res = _applies(PATCHES / name, ROOT)
    assert res.returncode == 0, res.stderr


def test_every_patch_is_checked_here():
    assert {p.name for p in PATCHES.glob("*.patch")} == {*BLIS_PATCHES, *PROJECT_PATCHES}
