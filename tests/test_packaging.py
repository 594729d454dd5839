"""``embodirl`` finds its config tree from an installed (non-editable) wheel, not only from a checkout."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import sys
# drop the editable-install finder so that only the unpacked wheel can provide 'embodirl'
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__name__", type(f).__name__)]
sys.path.insert(0, sys.argv[1])
import embodirl.paths as P
from embodirl.config import compose
assert P.source_root() is None, P.source_root()
assert str(P.config_dir()).startswith(sys.argv[1]), P.config_dir()
cfg = compose(["env=libero_10"])
print(P.config_dir(), cfg.env.eval.max_episode_steps)
"""


def test_config_found_in_installed_wheel(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True)
    wheel = next(wheels.glob("embodirl-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    assert (target / "embodirl" / "_config" / "env" / "libero_10.yaml").is_file()
    proc = subprocess.run([sys.executable, "-c", PROBE, str(target)], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(" 520")
