"""The docs say what minirt measures today and how to reproduce it.

docs/performance.md: every table sits under a heading whose metadata list names the command that
reproduces it, the date it was measured, the GPU, the software and the ceilings measured in that run.
No docs page is a dated log or speaks of how the work is organised, docs/perf/ holds the kernel pages
and their plots only (no raw run outputs), and every relative link in the docs and the README
resolves to a file of the repository."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PERFORMANCE = DOCS / "performance.md"
KERNEL_PAGES = {"prefill.md", "decode.md", "indexer.md", "gemm.md", "runtime.md", "moe.md"}
METADATA = ("Command", "Measured", "GPU", "Software", "Ceilings")

HEADING = re.compile(r"^#{1,6} ")
DATED_HEADING = re.compile(r"^#{1,6} .*\b\d{4}-\d{2}-\d{2}\b")
# Remarks about how the work was organised rather than what minirt does.
HISTORY = re.compile(r"\bsessions?\b|\bdevice calls?\b|\bcall \d+\b", re.IGNORECASE)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def doc_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def sections(text: str) -> list[tuple[str, list[str]]]:
    """(heading, lines up to the next heading) for every heading of a markdown page."""
    out: list[tuple[str, list[str]]] = [("", [])]
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and HEADING.match(line):
            out.append((line, []))
        else:
            out[-1][1].append(line)
    return out


def table_problems(text: str) -> list[str]:
    """What each table's section lacks: a '- Key: value' line for every METADATA key, each with the
    content that key promises (a command in backticks, a date, numbers with units)."""
    problems = []
    for heading, lines in sections(text):
        if not any(line.lstrip().startswith("|") for line in lines):
            continue
        meta = {}
        for line in lines:
            m = re.match(r"^- (\w+): (.+)$", line)
            if m and m.group(1) in METADATA:
                meta[m.group(1)] = m.group(2)
        where = heading or "(before the first heading)"
        for key in METADATA:
            if key not in meta:
                problems.append(f"{where}: no '- {key}:' line")
        checks = {"Command": r"`[^`]+`", "Measured": r"\b\d{4}-\d{2}-\d{2}\b",
                  "Software": r"torch \S+.*triton \S+", "Ceilings": r"\d+ TFLOP/s.*\d+ GB/s",
                  "GPU": r"\S"}
        for key, pattern in checks.items():
            if key in meta and not re.search(pattern, meta[key]):
                problems.append(f"{where}: '- {key}:' lacks {pattern!r}: {meta[key]!r}")
    return problems


def test_every_performance_table_names_its_run():
    text = PERFORMANCE.read_text(encoding="utf-8")
    assert text.count("\n|") >= 6, "docs/performance.md has lost its tables"
    assert table_problems(text) == []


def test_the_table_check_catches_a_missing_line():
    complete = ("## Decode\n\n- Command: `python3 scripts/bench_decode.py`\n- Measured: 2026-11-30\n"
                "- GPU: NVIDIA H200\n- Software: torch 2.11.0, triton 3.6.0\n"
                "- Ceilings: bf16 matmul 798 TFLOP/s, copy 4247 GB/s\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert table_problems(complete) == []
    assert table_problems(complete.replace("- Ceilings: bf16 matmul 798 TFLOP/s, copy 4247 GB/s\n", "")) \
        == ["## Decode: no '- Ceilings:' line"]
    assert len(table_problems(complete.replace("2026-11-30", "recently"))) == 1
    # A table under a heading of its own does not borrow the metadata of the section above it.
    assert len(table_problems(complete + "\n## FlashMLA side by side\n\n| c |\n|---|\n| 3 |\n")) == 5


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_is_a_work_log(page):
    text = page.read_text(encoding="utf-8")
    dated = [line for line in text.splitlines() if DATED_HEADING.match(line)]
    assert dated == [], f"dated section headings: {dated}"
    history = sorted({m.group(0) for m in HISTORY.finditer(text)})
    assert history == [], f"remarks about how the work was organised: {history}"


def test_perf_holds_the_kernel_pages_and_their_plots_only():
    perf = DOCS / "perf"
    pages = {p.name for p in perf.iterdir() if p.suffix == ".md"}
    assert pages == KERNEL_PAGES
    linked = "\n".join((perf / name).read_text(encoding="utf-8") for name in pages)
    others = sorted(p.name for p in perf.iterdir() if p.suffix != ".md")
    assert [name for name in others if not (name.endswith(".png") and f"({name})" in linked)] == [], \
        "docs/perf/ files that are neither a kernel page nor a plot a page shows"


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [m.group(1) for m in LINK.finditer(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", [ROOT / "README.md", *doc_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert broken == []


def test_the_link_check_sees_links():
    assert "perf/decode.md" in relative_links(PERFORMANCE)
