"""The documentation, checked: the site builds with `mkdocs build --strict` (no broken link, anchor or missing page),
every example marked runnable runs as printed, the README stays a landing page, and no sentence or figure goes stale.

Runnable examples: a fenced ```bash or ```python block in README.md or docs/**/*.md whose previous non-blank line is
`<!-- runnable -->` (invisible on GitHub and on the site). A file's runnable blocks run in order in one fresh folder,
as a user types them after the README's set-up lines: `.venv` there is this interpreter's virtual environment,
`benchmarks/` the checkout's, and the alias `smollm2-135m` resolves to a tiny random model through SPECEXPORT_MODELS
(the first place an alias is looked up), so the README's hello world builds and runs in seconds. bash blocks run with
`bash -e` (PATH starts with the environment's bin), python blocks with this interpreter. Builds use no hardware
profile (conftest sets SPECEXPORT_PROFILE=off), so they do not depend on the machine.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_folder, tiny_model

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w+)")
# the README's set-up lines, then the examples (CI runs the line under "# 2. Tests" itself)
README_LINES = 250


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def written_docs() -> list[Path]:
    """The docs people wrote (not the reports `specexport profile` generated, which carry their own headers)."""
    return [p for p in doc_files() if not (p.name == "report.md" and "profiles" in p.parts)] + [ROOT / "CHANGELOG.md"]


def code_blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """(line number, language, code, runnable) of each fenced block."""
    lines, blocks, k = text.splitlines(), [], 0
    while k < len(lines):
        m = FENCE.match(lines[k])
        if not m:
            k += 1
            continue
        start, end = k, k + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        before = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        blocks.append((start + 1, m.group(1), "\n".join(lines[start + 1:end]), before == MARK))
        k = end + 1
    return blocks


def runnable(path: Path) -> list[tuple[int, str, str]]:
    return [(line, lang, code) for line, lang, code, marked in code_blocks(path.read_text(encoding="utf-8")) if marked]


RUNNABLE = [p for p in doc_files() if runnable(p)]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Path:
    """SPECEXPORT_MODELS for the examples: `smollm2-135m` is a tiny random Llama with a byte-level tokenizer (4096
    positions, so that the benchmark prompts fit)."""
    models = tmp_path_factory.mktemp("models")
    save_folder(tiny_model("llama", max_position_embeddings=4096), models / "smollm2-135m")
    return models


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def run_examples(path: Path, folder: Path, models: Path, blocks=None) -> None:
    """Run `path`'s runnable blocks (or `blocks`) in order in `folder`; fail with the block, its place and its output."""
    folder.mkdir(parents=True, exist_ok=True)
    if sys.prefix != sys.base_prefix and not (folder / ".venv").exists():
        (folder / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    if not (folder / "benchmarks").exists():
        (folder / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    env = {**os.environ, "SPECEXPORT_MODELS": str(models), "HF_HUB_OFFLINE": "1", "NO_MKDOCS_2_WARNING": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for line, lang, code in blocks if blocks is not None else runnable(path):
        if lang in ("bash", "sh", "shell"):
            command = ["bash", "-e", "-c", code]
        elif lang == "python":
            command = [sys.executable, "-c", code]
        else:
            pytest.fail(f"{path.name}:{line}: a runnable block must be bash or python, not {lang}")
        done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, (f"{shown(path)}:{line}: the example exits {done.returncode}\n"
                                      f"{code}\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n"
                                      f"{done.stderr[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("path", RUNNABLE, ids=[str(p.relative_to(ROOT)) for p in RUNNABLE])
def test_runnable_examples_run(path, tiny_models, tmp_path):
    run_examples(path, tmp_path / "work", tiny_models)


def test_a_broken_example_fails(tiny_models, tmp_path):
    """The runner is not blind: an example whose command no longer exists, or whose option was renamed, fails."""
    page = tmp_path / "page.md"
    page.write_text(f"{MARK}\n```bash\nspecexport run nothing --prompt hi --no-such-option\n```\n")
    with pytest.raises(AssertionError, match="page.md:2: the example exits 2"):
        run_examples(page, tmp_path / "work", tiny_models)
    page.write_text(f"{MARK}\n```python\nfrom specexport.runtime.generate import NoSuchEngine\n```\n")
    with pytest.raises(AssertionError, match="ImportError"):
        run_examples(page, tmp_path / "work", tiny_models)


def test_the_docs_site_builds_strictly(tmp_path):
    """mkdocs build --strict: every page in the nav exists, every link and anchor resolves, the API pages render from
    the docstrings and the CLI reference from the Click commands."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cli = (tmp_path / "site" / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("build", "run", "bench", "serve", "train", "profile", "check-trt", "embed", "datastore", "triton"):
        assert f"specexport {command}" in cli, command
    assert "--draft-top-k" in cli and "--baseline" in cli


def test_the_readme_is_a_landing_page():
    """At most 250 lines; the set-up lines first, with CI's marker; then a hello world that runs a prompt."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_LINES
    blocks = code_blocks(text)
    assert blocks[0][2].startswith("# 1. Main job") and "specexport bench" in blocks[0][2]
    tests = blocks[1][2].splitlines()
    assert tests[0].startswith("# 2. Tests") and len(tests) == 2 and "pytest tests" in tests[1]
    line, lang, code, marked = blocks[2]
    assert marked and "specexport run" in code and "--prompt" in code, (line, code)
    assert "specexport build --model smollm2-135m" in code


STALE = re.compile(r"\b(?:this|the last|the previous) version\b|\bthe previous run\b|\bat this commit\b"
                   r"|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}\b")


@pytest.mark.parametrize("path", written_docs(), ids=[str(p.relative_to(ROOT)) for p in written_docs()])
def test_no_sentence_goes_stale(path):
    """No sentence names a commit, "this version" or "the previous run": what they mean changes with every commit.
    Nor a machine's path."""
    text = path.read_text(encoding="utf-8")
    found = [(n, m.group(0)) for n, line in enumerate(text.splitlines(), 1) for m in STALE.finditer(line)]
    assert not found, found
    assert "/work/" not in text and "/root/" not in text


def sections(text: str):
    """(heading, body) of each part of a page, split at its headings."""
    parts = re.split(r"^(#{1,3} .*)$", text, flags=re.M)
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("path", written_docs(), ids=[str(p.relative_to(ROOT)) for p in written_docs()])
def test_figures_carry_their_date_and_cpu(path):
    """Every table of tokens/s is in a part that names its date and the CPU's instruction-set features (or says they
    were not recorded)."""
    for heading, body in sections(path.read_text(encoding="utf-8")):
        if not re.search(r"^\|.*tokens/s.*\|$", body, flags=re.M):
            continue
        where = f"{path.name}: {heading or 'the top'}"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", heading + body), f"{where}: a table of figures with no date"
        assert re.search(r"AVX|VNNI|AMX|features not recorded", body), f"{where}: no CPU features"
