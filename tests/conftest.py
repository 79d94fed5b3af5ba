import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def shared_data_dir() -> Path:
    from primitives.data.roots import shared_data_root

    return shared_data_root() / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    d = shared_data_dir()
    if not (d / "steps" / "step_traces.parquet").exists():
        pytest.skip(f"shared real data not found at {d} (set STEPSYNTH_SHARED to the shared/ folder)")
    return d
