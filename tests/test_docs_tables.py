"""The results tables of README.md and docs/benchmarks.md are the ones benchmarks/docs_tables.py
writes from benchmarks/results/ (CPU, no torch), every committed result file is in the index,
and every link of those pages reaches a file and, with a #fragment, an anchor in it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "docs/benchmarks.md", "benchmarks/results/README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_tables_match_the_results():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "docs_tables.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr


def anchors(path: str) -> set:
    with open(path) as f:
        text = f.read()
    found = set(re.findall(r'<a id="([^"]+)"', text))
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_links_reach_their_targets():
    missing = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = f.read()
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, frag = target.partition("#")
            full = (
                os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path))
                if path
                else (os.path.join(ROOT, page))
            )
            if not os.path.exists(full):
                missing.append(f"{page}: {target} (no such file)")
            elif frag and full.endswith(".md") and frag not in anchors(full):
                missing.append(f"{page}: {target} (no such anchor)")
    assert not missing, "\n".join(missing)


def test_every_readme_figure_links_to_its_row():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    block = text.split("<!-- tables:readme begin -->")[1].split("<!-- tables:readme end -->")[0]
    rows = [r for r in block.splitlines() if r.startswith("| ") and "---" not in r]
    body = [r for r in rows if not r.startswith("| workload or trainer")]
    assert body and all("](docs/benchmarks.md#" in r for r in body)
