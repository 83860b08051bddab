"""The benchmarks keep running: a quick pass of each writes its JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_cache_quick(tmp_path):
    out = tmp_path / "cache.json"
    subprocess.run([sys.executable, str(ROOT / "bench" / "bench_cache.py"), "--quick", "--out", str(out)],
                   check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    assert set(result["rollback_ns_median"]["native"]) == {"1000", "100000", "1000000"}
    assert set(result["ops_per_second"]) == {"append", "rollback", "fork", "free"}
    assert all(r["native"] > 0 and r["python"] > 0 for r in result["ops_per_second"].values())
