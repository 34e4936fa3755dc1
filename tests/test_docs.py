"""The README and the guides in docs/ against the repository: links resolve, cited result
files exist, figures are the cited file's, and docs/configuration.md is the schema's.

Why: the README and the guides quote measured figures and point at files; a figure retyped
wrong, a result file renamed or a guide moved would otherwise go unnoticed until a reader
followed it. Everything here reads text only, so it runs in the default suite in well under a
second.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 200

# A cited result file: a committed benchmark report or a masking experiment's output.
RESULT_FILE = re.compile(r"(?<![\w/.-])((?:bench_results/[\w.-]+\.(?:md|json))"
                         r"|(?:experiments_results/[\w.-]+\.\w+))")
# A markdown link's target: [text](target), images included.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A number the figure check holds to its file: one with a decimal point (and an exponent, as
# in 4.1e-5), or one followed by "x" (a ratio or a multiple).
NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)+(?:e-?\d+)?|\d+(?=x\b))")
# Version numbers are not figures: "TRL 1.16", "PEFT 0.21", "oneDNN 3.2" name the software a
# figure was measured with, not something the file measured. A number right after one of
# these names (or with two dots, as 0.25.3) is exempt.
# Result files named as what a future run will write, not cited as results.
NOT_YET = {"bench_results/train-cuda.md"}   # the GPU benchmark's, once a GPU run is made
VERSION_OF = ("TRL", "PEFT", "transformers", "torch", "oneDNN", "Mesa", "Python ≥", "CUDA",
              "nvcc", "ggml", "headers", "llama-cpp-python", "bookworm's", "trixie's")


def doc_files() -> list[Path]:
    return [README] + sorted((ROOT / "docs").glob("*.md"))


def blocks(text: str) -> list[str]:
    """The paragraphs, list items and table rows of a markdown text, fenced code blocks and
    indented code blocks left out (a command's output is not a figure to hold to a file)."""
    out, cur, fenced = [], [], False

    def flush():
        if cur:
            out.append(" ".join(cur))
            cur.clear()

    for line in text.split("\n"):
        if line.startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced or line.startswith("    ") and not cur:
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            flush()
        elif stripped.startswith("|"):
            flush()
            out.append(stripped)
        elif re.match(r"[*-] |\d+\. ", stripped):
            flush()
            cur.append(stripped)
        else:
            cur.append(stripped)
    flush()
    return out


def figures(block: str) -> list[str]:
    """The numbers of a block the figure check holds to its cited file."""
    text = re.sub(r"`[^`]*`", lambda m: m.group(0) if "results/" not in m.group(0) else "",
                  block)
    found = []
    for m in NUMBER.finditer(text):
        num = m.group(1)
        before = text[:m.start()].rstrip()
        if num.count(".") > 1 or any(before.endswith(v) for v in VERSION_OF):
            continue
        found.append(num)
    return found


def in_file(num: str, text: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(num)}(?!\d)", text) is not None


def test_readme_is_short():
    """A newcomer reads it in five minutes; the details live in docs/."""
    n = len(README.read_text().split("\n"))
    assert n <= README_MAX_LINES, f"README.md has {n} lines; at most {README_MAX_LINES}"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a markdown file's headings: lower case, punctuation
    dropped, spaces as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        m = re.match(r"#+ (.*)", line)
        if fenced or not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_resolve():
    """Every relative link names a file that exists and, with #anchor, a heading in it."""
    bad = []
    for path in doc_files():
        for target in LINK.findall(path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = path.parent / file if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "links to missing files or headings:\n" + "\n".join(bad)


def test_cited_result_files_exist():
    bad = sorted({f"{path.relative_to(ROOT)}: {name}" for path in doc_files()
                  for name in RESULT_FILE.findall(path.read_text())
                  if not (ROOT / name).exists() and name not in NOT_YET})
    assert not bad, "cited result files that do not exist:\n" + "\n".join(bad)


def test_figures_are_the_cited_files():
    """Each paragraph, list item or table row citing exactly one result file quotes that
    file's numbers: a figure with a decimal point or an "x" must appear in it verbatim."""
    bad = []
    for path in doc_files():
        for block in blocks(path.read_text()):
            cited = set(RESULT_FILE.findall(block))
            if len(cited) != 1:
                continue
            (name,) = cited
            if not (ROOT / name).exists():
                continue
            text = (ROOT / name).read_text(errors="replace")
            missing = [n for n in figures(block) if not in_file(n, text)]
            if missing:
                bad.append(f"{path.relative_to(ROOT)}: {name} lacks {missing}: "
                           f"{block[:100]}...")
    assert not bad, "figures not in the file they cite:\n" + "\n".join(bad)


def test_configuration_md_matches_schema():
    """docs/configuration.md is generated from pytrain/config/schema.py; a key added, renamed
    or re-documented in the schema must reach the page."""
    from scripts.make_config_docs import OUT, render
    assert OUT.read_text() == render(), (
        "docs/configuration.md differs from the schema: run `python -m scripts.make_config_docs`")


def test_each_guide_starts_with_an_example():
    """A guide opens with something to run (a shell or TOML block), then explains it; the
    reference pages written before the guides (formats, ggml) and the Python API's page,
    kept by its own work, are left to their own form."""
    bad = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        if path.name in ("formats.md", "ggml.md", "python.md"):
            continue
        text = re.sub(r"<!--.*?-->", "", path.read_text(), flags=re.S)
        lines = [ln for ln in text.split("\n")[1:] if ln.strip()]
        if not lines or lines[0] not in ("```sh", "```toml"):
            bad.append(path.name)
    assert not bad, f"guides that do not open with a shell or TOML example: {bad}"
