"""The docs hold together: every relative link and `#anchor` of README.md, CHANGELOG.md and docs/*.md resolves
(anchors as GitHub makes them from headings), and docs/architecture.md names every module of the package."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "optimum_qnn"
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The text without fenced code blocks (a `# comment` in a bash block is not a heading) and inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lowercased, markup and punctuation dropped (letters, digits, `_`, `-` and
    spaces kept), spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading)  # HTML comments and tags
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        slug = github_anchor(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def dead_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or anchor does not exist, each as `page: target (why)`."""
    wrong = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ... are not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            wrong.append(f"{page.name}: {target} (no file {resolved})")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
            wrong.append(f"{page.name}: {target} (no heading #{anchor} in {resolved.name})")
    return wrong


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert page.is_file()
    assert dead_links(page) == []


def test_the_pages_are_found_and_link_to_each_other():
    names = {str(p.relative_to(REPO)) for p in PAGES}
    assert {"docs/exporting.md", "docs/running.md", "docs/architecture.md", "docs/benchmarks.md",
            "docs/runner_contract.md"} <= names
    readme_links = LINK.findall(prose((REPO / "README.md").read_text()))
    for page in PAGES[2:]:  # the README links every docs page
        assert any(link.split("#")[0] == f"docs/{page.name}" for link in readme_links), page.name


def test_github_anchors():
    assert github_anchor("Run, chat, serve") == "run-chat-serve"
    assert github_anchor("Run with ExecuTorch's C++ runner on this machine") == (
        "run-with-executorchs-c-runner-on-this-machine")
    assert github_anchor("The `--soc` table <!-- x -->") == "the---soc-table"
    assert github_anchor("[Unreleased]") == "unreleased"
    assert anchors("# A\n## A\n```bash\n# not a heading\n```\n") == {"a", "a-1"}


def test_a_dead_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Its section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#its-section) [ok](#page) [web](https://example.com/x.md) `[code](nowhere.md)`\n"
        "```\n[in a block](nowhere.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#no-such) [bad here](#nope)\n"
    )
    assert dead_links(page) == [
        f"page.md: missing.md (no file {tmp_path / 'missing.md'})",
        "page.md: other.md#no-such (no heading #no-such in other.md)",
        "page.md: #nope (no heading #nope in page.md)",
    ]


# --- docs/architecture.md names every module ----------------------------------------------------------------------


def package_names(root: Path) -> set[str]:
    """How the architecture page names each module: `a/b.py` for a module, `a/` for a package (its __init__.py),
    both relative to the package folder; the package's own __init__.py and __main__.py by their file names."""
    names = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.name == "__init__.py":
            names.add(f"{rel.parent.as_posix()}/" if rel.parent != Path(".") else "__init__.py")
        else:
            names.add(rel.as_posix())
    return names


def unnamed_modules(page_text: str, root: Path) -> list[str]:
    named = set(re.findall(r"`([^`\s]+)`", page_text))
    return sorted(package_names(root) - named)


def test_the_architecture_page_names_every_module():
    names = package_names(PACKAGE)
    assert len(names) > 80 and "exporter/by_reference.py" in names and "runtime/backends/" in names
    missing = unnamed_modules((REPO / "docs" / "architecture.md").read_text(), PACKAGE)
    assert missing == [], "name these in docs/architecture.md, with a one-line role: " + ", ".join(missing)


def test_an_unnamed_module_is_found(tmp_path):
    (tmp_path / "wing" / "inner").mkdir(parents=True)
    for name in ("__init__.py", "core.py", "wing/__init__.py", "wing/a.py", "wing/inner/__init__.py", "wing/inner/b.py"):
        (tmp_path / name).write_text("")
    page = "| `__init__.py` | `core.py` | `wing/` | `wing/a.py` | `wing/inner/` | b.py |"
    assert unnamed_modules(page, tmp_path) == ["wing/inner/b.py"]


# --- the commands the pages show are commands the CLI takes -------------------------------------------------------

BLOCK = re.compile(r"^```(?:bash|sh|powershell)?[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
COMMAND = re.compile(r"^(python -m optimum_qnn|optimum-cli export qnn) ")


def documented_commands(text: str) -> list[str]:
    """Every `python -m optimum_qnn ...` and `optimum-cli export qnn ...` line of the page's code blocks (continued
    lines joined; a block may be indented, as in a numbered list)."""
    commands = []
    for block in BLOCK.findall(re.sub(r"(?m)^[ \t]+(?=```)", "", text)):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if COMMAND.match(line):
                commands.append(line)
    return commands


def refusal(command: str) -> str | None:
    """Why the CLI would refuse ``command`` before doing any work (its arguments, the SoC, scheme and device
    names), or None. Nothing runs: the arguments are parsed and mapped onto configs only."""
    import contextlib
    import io
    import shlex

    from optimum_qnn.__main__ import build_parser
    from optimum_qnn.cli import configs_from_args
    from optimum_qnn.config import RECIPES, QuantScheme, Soc
    from optimum_qnn.errors import OptimumQnnError
    from optimum_qnn.runtime.backends.device import DeviceSpec

    words = shlex.split(command, comments=True)
    argv = ["export", *words[3:]] if words[0] == "optimum-cli" else words[3:]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = build_parser().parse_args(argv)
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    try:
        if args.command == "export":
            configs_from_args(args)
        else:
            if getattr(args, "soc", None):
                Soc.parse(args.soc)
            if getattr(args, "quant", None) and args.quant not in RECIPES:
                QuantScheme.parse(args.quant)
            if getattr(args, "device", None):
                DeviceSpec.parse(args.device)
    except OptimumQnnError as e:
        return str(e)
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_a_page_shows_is_one_the_cli_takes(page):
    commands = documented_commands(page.read_text())
    assert [(c, why) for c in commands if (why := refusal(c))] == []


def test_the_pages_show_commands_and_a_wrong_one_is_refused():
    readme = documented_commands((REPO / "README.md").read_text())
    assert any(c.startswith("optimum-cli export qnn") for c in readme)
    assert {c.split()[3] for c in readme if c.startswith("python -m")} >= {"run", "chat", "serve"}
    assert len(documented_commands((REPO / "docs" / "running.md").read_text())) >= 5
    assert "unrecognized arguments: --sco" in refusal("python -m optimum_qnn run m --sco SM8750 --prompt hi")
    assert "SM9999" in refusal("optimum-cli export qnn --model m --output o --soc SM9999")
    assert "Unknown device 'phone'" in refusal("python -m optimum_qnn run m --device phone --prompt hi")
    assert refusal("python -m optimum_qnn run m --soc SM8750 --device adb --prompt 'hi'  # a comment") is None


def test_the_readme_soc_summary_is_what_the_code_supports():
    """The README's short SoC table (the full one is generated into docs/exporting.md): every HTP arch once, each
    SoC it names of that arch, and each row's schemes those the code lets the arch run ("all": every scheme)."""
    from optimum_qnn.config import QuantScheme, Soc
    from optimum_qnn.socs import HTP_ARCHS, arch_supports

    section = (REPO / "README.md").read_text().split("## Supported SoCs and models", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| v")]
    seen = []
    for arches_cell, socs_cell, schemes_cell in rows:
        arches = [int(a) for a in re.findall(r"v(\d+)", arches_cell)]
        seen += arches
        for soc in re.findall(r"`([A-Z0-9]+)`", socs_cell):
            assert Soc.parse(soc).htp_arch in arches, (soc, arches_cell)
        for arch in arches:
            runs = {q.value for q in QuantScheme if arch_supports(arch, q.value)}
            written = {q.value for q in QuantScheme} if schemes_cell == "all" else set(re.findall(r"`([^`]+)`", schemes_cell))
            assert written == runs, (arch, schemes_cell, sorted(runs))
    assert sorted(seen) == sorted(HTP_ARCHS)
