"""Issue 17 item 7: the README's SSP bound in the unit the progress bar prints.

`--staleness K` counts steps; the staleness the workers report (progress bar `stale`, metrics,
summary) counts versions: updates applied to a table between a worker's pull and its push. The
README states the bound in versions: with W workers, at most (W-1)(2K+1)+2. Checked here on a
real run (one shard process, two `tessera worker` processes, worker 1 a 20x straggler with
jitter on both), the README's own user task."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


@pytest.mark.timeout(120)
def test_ssp_staleness_in_versions_within_the_readme_bound(proc_cluster, tmp_path) -> None:
    text = open(README).read()
    assert "(W-1)(2K+1)+2" in text  # the bound this test checks is the one the README states
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if b.startswith("# mytask.py"))
    (tmp_path / "mytask.py").write_text(block)
    (address,) = proc_cluster(1)
    W, K = 2, 1
    exe = shutil.which("tessera", path=os.path.dirname(sys.executable)) or "tessera"
    base = [exe, "worker", "--ps", address, "--task", "mytask:make", "--mode", "ssp", "--staleness", str(K),
            "--steps", "80", "--batch-size", "16", "--num-workers", str(W), "--no-progress", "--jitter-ms", "3"]
    procs = [
        subprocess.Popen([*base, "--worker-index", str(i), "--metrics-out", str(tmp_path / f"m{i}.jsonl"),
                          *(["--slowdown", "20"] if i == 1 else [])], cwd=str(tmp_path), stderr=subprocess.PIPE, text=True)
        for i in range(W)
    ]
    errs = [p.communicate(timeout=100)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * W, errs
    worst = []
    for i in range(W):
        summary = [json.loads(line) for line in (tmp_path / f"m{i}.jsonl").read_text().splitlines() if '"summary"' in line][-1]
        worst.append(summary["max_staleness"])
        assert "staleness (in versions)" in errs[i]  # the summary line names the unit
    assert max(worst) <= (W - 1) * (2 * K + 1) + 2, worst
    assert max(worst) >= 1, worst  # other workers' updates did land in between: versions, not a step count
