"""scripts/gpu_check.sh where there is no GPU (what can run here): one line and a non-zero exit, nothing written;
and its report's rule for where two outputs part."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_without_a_gpu_the_check_is_one_line(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")  # a driver tool that lists no GPU
    (fake / "nvidia-smi").chmod(0o755)
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path, capture_output=True,
                            text=True, env={"PATH": f"{fake}:/usr/bin:/bin"}, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["gpu_check: no NVIDIA GPU here (nvidia-smi lists none)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


def test_the_report_names_the_first_differing_token():
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_check import first_difference

    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one stopped (EOS) where the other went on
