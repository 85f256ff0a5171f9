"""The site: `mkdocs build --strict` passes, each stage page shows its lesson from its one source,
and `python -m pagedref.figures` draws every figure the site uses."""

from __future__ import annotations

import html
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedref import course, figures

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
import markdown  # noqa: E402  (installed with mkdocs)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


def _page(site: Path, name: str) -> str:
    path = site / name / "index.html"
    assert path.is_file(), f"the site has no page {name}/"
    return path.read_text()


def _text(fragment: str) -> str:
    """Visible text of some HTML, whitespace collapsed (headings lose their permalink mark)."""
    fragment = re.sub(r'<a class="headerlink".*?</a>', "", fragment, flags=re.S)
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", fragment)).split())


def _headings(page_html: str) -> list[str]:
    return [_text(h) for h in re.findall(r"<h[1-6][^>]*>(.*?)</h[1-6]>", page_html, re.S)]


def test_site_builds_strict_with_its_pages(site):
    for name in ("architecture", "numerics", "benchmarks", "course"):
        _page(site, name)
    assert (site / "index.html").is_file()
    api = "".join(p.read_text() for p in (site / "api").rglob("index.html"))
    for module in ["pagedref.attention", *course.lesson_modules()]:  # the API reference documents the lessons
        assert f'id="{module}"' in api, f"the API reference has no section for {module}"


@pytest.mark.parametrize("stage", course.STAGES, ids=lambda s: s.marker)
def test_stage_page_shows_its_lesson(site, stage):
    page_md = ROOT / "docs" / "stages" / f"{stage.slug}.md"
    assert page_md.is_file(), f"missing {page_md.relative_to(ROOT)}"
    lines = [l for l in page_md.read_text().splitlines() if l.strip() and not l.lstrip().startswith("<!--")]
    assert lines == [f'--8<-- "stages/{stage.folder}/README.md"'], \
        f"{page_md.relative_to(ROOT)} must only include the lesson (its one source), not copy it"
    assert stage.readme.is_file(), f"stage {stage.number}'s lesson {stage.readme.relative_to(ROOT)} is not written yet"
    page = _page(site, f"stages/{stage.slug}")
    # The lesson rendered on its own: its headings must all be on the page, in order.
    alone = markdown.markdown(stage.readme.read_text(), extensions=["fenced_code", "tables", "admonition"])
    wanted, found = _headings(alone), iter(_headings(page))
    assert wanted, f"{stage.readme.relative_to(ROOT)} has no heading"
    assert all(h in found for h in wanted), f"stage {stage.number}'s page lacks lesson headings {wanted}"
    first_paragraph = next((_text(p) for p in re.findall(r"<p>(.*?)</p>", alone, re.S) if "[" not in _text(p)), "")
    assert first_paragraph[:200] in _text(page)
    assert f"pytest stages -m stage{stage.number}" in _text(page)  # the generated footer: how to run it


def test_lesson_links_work_on_the_site(site):
    """A lesson links relative to its stage folder; on the site those links point at pages that exist."""
    for stage in course.STAGES:
        if not stage.readme.is_file():
            continue
        page_dir = site / "stages" / stage.slug
        for href in re.findall(r'<a [^>]*href="([^"#]+)', (page_dir / "index.html").read_text()):
            if re.match(r"^[a-z]+:", href) or href.startswith("/"):
                continue
            target = (page_dir / href).resolve()
            assert target.is_file() or (target / "index.html").is_file(), \
                f"stage {stage.number}'s page links to {href}, which is not on the site"


def test_figures_command_draws_every_figure(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pagedref.figures", "--quick", "--out", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in figures.FIGURES:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name}.png was not drawn"
    drawn = sorted(p.name for p in tmp_path.iterdir())
    assert drawn == sorted(Path(line).name for line in r.stdout.split()), "the command prints what it wrote"
    committed = sorted(p.name for p in (ROOT / "docs" / "figures").iterdir())
    assert drawn == committed, "docs/figures must hold exactly what `python -m pagedref.figures` draws"


def test_figures_rejects_an_unknown_name(tmp_path):
    with pytest.raises(ValueError, match="unknown figure"):
        figures.generate(tmp_path, only=["nope"])


def test_every_figure_is_on_the_site(site):
    pages = "".join(p.read_text() for p in site.rglob("*.html"))
    for name in figures.FIGURES:
        assert f"figures/{name}.png" in pages, f"no page shows figures/{name}.png"


def test_every_stage_page_shows_a_figure(site):
    for stage in course.STAGES:
        page = next((site / "stages").glob(f"{stage.number:02d}-*/index.html"))
        assert re.search(r'<img[^>]+src="[^"]*figures/[a-z_]+\.png"', page.read_text()), \
            f"the stage {stage.number} page shows no generated figure"


def test_what_the_lessons_say_of_their_figures_is_what_the_scheduler_does():
    """Stages 6 and 7 describe their figures in words; those words are checked against the runs."""
    steps = figures.continuous_batching_run()
    assert steps[6].preempted == ["F"], "stage 6 README: F is preempted at step 6"
    assert ("F", 5, False) in steps[10].scheduled, "stage 6 README: F is prefilled again at step 10, 5 tokens"
    whole = figures.WHOLE_PROMPT_BUDGET
    prefill_first = figures.scheduling_run(whole, 7, chunked=False, prefill_first=True)
    mixed = figures.scheduling_run(whole, 7, chunked=False)
    for step in (1, 2):
        assert not {"A", "B", "C"} & {name for name, _, _ in prefill_first[step]}, \
            "stage 7 README: under prefill first, A, B and C get no token in steps 1 and 2"
        assert {"A", "B", "C"} <= {name for name, _, _ in mixed[step]}, "stage 7 README: mixed, they decode every step"
    assert ("D", 70, False) in mixed[1], "stage 7 README: mixed, step 1 carries all of D's 70 tokens"
    assert max(sum(n for _, n, _ in step) for step in figures.scheduling_run(32, 7)) <= 32
