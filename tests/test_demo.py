"""The demo runs both modes on the same samples and their losses agree."""

import re
import subprocess
import sys


def test_demo_odc_matches_collective_losses():
    proc = subprocess.run(
        [sys.executable, "-m", "torch_odc.demo", "--device", "cpu", "--world-size", "4",
         "--minibatches", "2"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, (
        f"demo exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}")
    out = proc.stdout
    assert "collective: FSDP2" in out and "odc: FSDP2" in out, out
    odc_rows = out.split("odc: FSDP2")[1]
    counts = {tuple(int(n) for n in re.findall(r"r\d+:(\d+)", line))
              for line in odc_rows.splitlines() if re.match(r"\s+\d+\s", line)}
    assert any(len(set(c)) > 1 for c in counts), f"no uneven microbatch counts:\n{out}"
    diff = float(re.search(r"max difference ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-5, out
