import shutil
import subprocess
import sys
from pathlib import Path

from .conftest import REPO


def test_ruff_is_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    proc = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=REPO,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
