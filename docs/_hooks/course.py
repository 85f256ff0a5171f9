"""mkdocs hook: the course on the site, every page from its one source.

One idea: nothing the site shows about a stage is written twice. A stage page (docs/stages/NN-name.md)
includes the lesson, stages/NN_name/README.md, with pymdownx.snippets; this hook does the rest:
- the nav gets one page per stage of `pagedref.course.STAGES` and one API reference page per part of
  the package that exists (so no page names a module that is not there);
- a lesson's relative links are written for the stage folder (its tests, the code, ../../docs/figures,
  another lesson); a treeprocessor points them at the same things on the site;
- source pages (src/<path>.md, out of the nav) show the stage tests, the lesson modules and any file a
  lesson links to, read from the repository at build time;
- each stage page ends with how to run it, its tests and its reference code, from the registry.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from markdown.extensions import Extension
from markdown.treeprocessors import Treeprocessor
from mkdocs.structure.files import File, Files, InclusionLevel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pagedref import course  # noqa: E402  (the checkout's own registry, even without pip install)

log = logging.getLogger("mkdocs.hooks.course")
API_ORDER = ["attention", "memory", "kernels", "backends", "models", "engine", "bench", "generate", "course", "figures"]
_INCLUDE = re.compile(r'^[ \t]*--8<--[ \t]+"([^"]+)"[ \t]*$', re.M)
_STAGE_TABLE = re.compile(r"^<!-- stage-table\b.*-->$", re.M)
_LINK = re.compile(r'\]\(\s*<?([^)\s>]+)|\bsrc=["\']([^"\']+)')
_state: dict = {"docs": None, "page_dir": None, "lesson_dirs": []}  # the page being rendered


# --- what exists ----------------------------------------------------------------------------------
def api_groups() -> dict[str, list[str]]:
    """{"memory": ["pagedref.memory", "pagedref.memory.contiguous", ...], ...}: public modules by part."""
    lessons = course.lesson_modules()
    groups: dict[str, list[str]] = {}
    for path in sorted((ROOT / "pagedref").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if len(parts) < 2 or any(p.startswith("_") for p in parts):
            continue
        if not all((ROOT.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            continue  # not importable yet (a folder without __init__.py)
        groups.setdefault(parts[1], []).append(".".join(parts))
    for mods in groups.values():  # the package first, then its lesson modules in stage order
        mods.sort(key=lambda m: (m.count("."), lessons.index(m) if m in lessons else len(lessons), m))
    rank = {g: i for i, g in enumerate(API_ORDER)}
    return dict(sorted(groups.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def _linked_files(readme: Path) -> set[Path]:
    """Repository files (outside docs/) that a lesson links to."""
    found = set()
    for m in _LINK.finditer(readme.read_text()):
        url = (m.group(1) or m.group(2)).split("#")[0]
        if not url or re.match(r"^[a-z][a-z0-9+.-]*:", url, re.I) or url.startswith("/"):
            continue
        target = (readme.parent / url).resolve()
        if target.is_file() and target.is_relative_to(ROOT) and not target.is_relative_to(ROOT / "docs"):
            found.add(target)
    return found


def source_files() -> list[Path]:
    """Files that get a source page: every stage's Python files, the lesson modules, what lessons link."""
    files: set[Path] = set()
    for s in course.STAGES:
        if s.path.is_dir():
            files |= {p for p in s.path.glob("*.py")}
        if s.readme.is_file():
            files |= _linked_files(s.readme)
        files |= {p for m in s.modules if (p := course.module_path(m)) is not None and p.is_relative_to(ROOT)}
    return sorted(f for f in files if f.name != "README.md" or f.parent.parent != ROOT / "stages")


def source_page(path: Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    fence = "`" * max(3, 1 + max((len(r) for r in re.findall(r"`+", text)), default=0))
    lang = {".py": "python", ".cu": "cuda", ".cuh": "cuda", ".md": "markdown", ".toml": "toml"}.get(path.suffix, "text")
    return f"# `{rel}`\n\n{fence}{lang}\n{text}\n{fence}\n"


# --- mkdocs events --------------------------------------------------------------------------------
def on_config(config):
    config.mdx_configs.setdefault("pymdownx.snippets", {})["base_path"] = [str(ROOT)]
    config.markdown_extensions.append(_LessonLinksExtension())
    stages = [{f"{s.number}. {s.title}": f"stages/{s.slug}.md"} for s in course.STAGES]
    for item in config.nav:
        if isinstance(item, dict) and "The course" in item:
            item["The course"] = [e for e in item["The course"] if e not in stages] + stages
    api = [{f"pagedref.{g}": f"api/{g}.md"} for g in api_groups()]
    config.nav = [e for e in config.nav if not (isinstance(e, dict) and "API reference" in e)] + [{"API reference": api}]
    return config


def on_files(files: Files, config) -> Files:
    for group, modules in api_groups().items():
        text = f"# pagedref.{group}\n\n" + "".join(f"::: {m}\n\n" for m in modules)
        files.append(File.generated(config, f"api/{group}.md", content=text))
    for path in source_files():
        src_uri = f"src/{path.relative_to(ROOT).as_posix()}.md"
        files.append(File.generated(config, src_uri, content=source_page(path), inclusion=InclusionLevel.NOT_IN_NAV))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = _state["docs"] = Path(config.docs_dir).resolve()
    _state["page_dir"] = (docs / page.file.src_uri).parent
    _state["lesson_dirs"] = [(ROOT / p).parent for p in _INCLUDE.findall(markdown) if Path(p).name == "README.md"]
    markdown = _STAGE_TABLE.sub(lambda m: _stage_table(_state["page_dir"], docs), markdown)
    stage = next((s for s in course.STAGES if page.file.src_uri == f"stages/{s.slug}.md"), None)
    if stage is None:
        return markdown
    if not stage.readme.is_file():
        log.info("stage %d: %s is not written yet", stage.number, stage.readme.relative_to(ROOT))
        markdown = (f"# {stage.number}. {stage.title}\n\n!!! warning \"Not written yet\"\n"
                    f"    This stage's lesson, `stages/{stage.folder}/README.md`, is not in the repository yet.\n\n"
                    + markdown)
    return markdown + "\n\n" + _footer(stage, _state["page_dir"], docs)


def _relative(path: Path, page_dir: Path) -> str:
    return Path(os.path.relpath(path, page_dir)).as_posix()


def _stage_table(page_dir: Path, docs: Path) -> str:
    rows = ["| stage | lesson | you write |", "|---|---|---|"]
    for s in course.STAGES:
        files = ", ".join(f"`{m}`" for m in s.modules)
        rows.append(f"| {s.number} | [{s.title}]({_relative(docs / 'stages' / f'{s.slug}.md', page_dir)}) | {files} |")
    return "\n".join(rows)


def _footer(stage: course.Stage, page_dir: Path, docs: Path) -> str:
    def to(path: Path) -> str:
        return _relative(path, page_dir)

    n = stage.number
    lines = ["---", "", "## Run this stage", "", "```bash",
             f"pytest stages -m stage{n}                        # the reference passes",
             "python -m pagedref.course init mypagedref        # once: your skeleton package",
             f"pytest stages -m stage{n} --impl mypagedref      # grade your implementation", "```", "",
             f"This page shows the lesson `stages/{stage.folder}/README.md` as it is in the repository: edit it there."]
    tests = stage.test_files()
    if tests:
        links = ", ".join(f"[`{t.name}`]({to(docs / 'src' / t.relative_to(ROOT).with_name(t.name + '.md'))})" for t in tests)
        lines += ["", f"**Tests:** {links}."]
    documented = {m for mods in api_groups().values() for m in mods}
    modules = [m for m in stage.modules if m in documented]
    if modules:
        lines += ["", "**Reference code:** " + ", ".join(f"[`{m}`][{m}]" for m in modules) + "."]
    return "\n".join(lines) + "\n"


# --- lesson links ---------------------------------------------------------------------------------
def _rewrite(url: str) -> str | None:
    """A lesson's link, written relative to its stage folder → the same target, relative to the page."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", url, re.I) or url.startswith(("#", "/")):
        return None
    path, hash_, fragment = url.partition("#")
    docs, page_dir = _state["docs"], _state["page_dir"]
    within = os.path.normpath(os.path.join(os.path.relpath(page_dir, docs), path))
    if not path or (not within.startswith("..") and (docs / within).exists()):  # already a link of the site
        return None
    stage_pages = {(s.path / "README.md").resolve(): docs / "stages" / f"{s.slug}.md" for s in course.STAGES}
    for lesson_dir in _state["lesson_dirs"]:
        target = (lesson_dir / path).resolve()
        if not target.is_file() or not target.is_relative_to(ROOT):
            continue
        if target.is_relative_to(docs):
            dest = target
        elif target in stage_pages:
            dest = stage_pages[target]
        else:
            dest = docs / "src" / (target.relative_to(ROOT).as_posix() + ".md")
        return Path(os.path.relpath(dest, page_dir)).as_posix() + hash_ + fragment
    return None


class _LessonLinks(Treeprocessor):
    def run(self, root):
        if not _state["lesson_dirs"]:
            return
        for el in root.iter():
            attr = {"a": "href", "img": "src"}.get(el.tag)
            if attr and el.get(attr):
                new = _rewrite(el.get(attr))
                if new is not None:
                    el.set(attr, new)


class _LessonLinksExtension(Extension):
    def extendMarkdown(self, md):
        # After inline parsing (links exist), before mkdocs' own relpath processor (priority 0) checks them.
        md.treeprocessors.register(_LessonLinks(md), "pagedref_lesson_links", 1)
