"""The project's documents are its own and its citations resolve (issue 27).

- Every ``docs/design.md §N`` cited in the code, tests and docs is a section of
  docs/design.md; nothing cites a design note outside the repository.
- Every repository path the README and docs/ name in backticks exists.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
CITATION = re.compile("docs/design\\.md \u00a7(\\d+)(?:[\u2013-]\u00a7?(\\d+))?")
OUTSIDE = re.compile(r"(?<!docs/)(?<![\w/])DESIGN\.md")


def tracked(*suffixes: str) -> list[pathlib.Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    return [ROOT / f for f in out if f.endswith(suffixes) and (ROOT / f).is_file()]


def sections() -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\. ", DESIGN.read_text(), flags=re.M)}


def test_every_cited_section_exists() -> None:
    have = sections()
    assert have == set(range(1, max(have) + 1)), "sections are numbered 1, 2, ... in order"
    cited: list[tuple[str, int]] = []
    for path in tracked(".py", ".md", ".yaml", ".toml", ".sh"):
        for m in CITATION.finditer(path.read_text(errors="replace")):
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            cited += [(str(path.relative_to(ROOT)), n) for n in range(lo, hi + 1)]
    assert len(cited) >= 8, "the code points into the design document"
    missing = [(f, n) for f, n in cited if n not in have]
    assert not missing, missing


def test_nothing_cites_a_design_note_outside_the_repository() -> None:
    hits = [str(p.relative_to(ROOT)) for p in tracked(".py", ".md", ".yaml", ".toml")
            if p.name != "test_docs.py" and OUTSIDE.search(p.read_text(errors="replace"))]
    assert not hits, hits


def test_paths_the_docs_name_exist() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    top = {p.name for p in ROOT.iterdir()}
    missing = []
    for doc in docs:
        for m in re.finditer(r"`([\w./-]+\.(?:py|md|yaml|json|sh|png|cpp))`", doc.read_text()):
            name = m.group(1)
            if name.split("/")[0] in top and not (ROOT / name).exists():
                missing.append((doc.name, name))
    assert not missing, missing


def test_the_readmes_python_runs() -> None:
    """The offline example of the README, as it is written (on the default preset)."""
    import contextlib
    import io

    from tests.presets import CACHE_DIR

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    assert blocks, "the README shows the offline API"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for code in blocks:  # the preset converted once, into the tests' cache folder
            exec(code.replace('LLM("gemma-3-270m")',
                              f'LLM("gemma-3-270m", cache_dir={str(CACHE_DIR)!r})'), {})
    assert len(out.getvalue().strip()) > 20


def test_links_between_documents_resolve() -> None:
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            target = m.group(1)
            if not target.startswith(("http://", "https://")) and \
                    not (doc.parent / target).exists():
                missing.append((doc.name, target))
    assert not missing, missing


def test_make_serve_and_the_readmes_curl(tmp_path: pathlib.Path) -> None:
    """The README's first command and its curl, as written (``make test`` is what CI runs;
    `make serve` here on another port, after the same install). The other presets and the
    flags pass through ``ARGS`` the same way."""
    import os
    import shlex
    import signal
    import time

    import httpx

    from tests.presets import CACHE_DIR
    from tests.server_utils import free_port

    text = (ROOT / "README.md").read_text()
    bash = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert bash[0].splitlines()[0].startswith("make serve")
    curl = next(b for b in bash if b.startswith("curl")).replace("\\\n", " ")
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(["make", "-s", "serve", f"ARGS=--port {port} --max-model-len 512"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "RINGSERVE_CACHE": str(CACHE_DIR)},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        out = subprocess.run(shlex.split(curl.replace(":8000", f":{port}")), check=True,
                             capture_output=True, text=True, timeout=120).stdout
        body = json.loads(out)
        assert body["usage"]["completion_tokens"] == 32 and body["choices"][0]["text"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
