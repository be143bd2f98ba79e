"""The docs' Python examples run against today's code.

Every ```python (or ```py) fenced block of ``README.md``, ``docs/*.md`` (not ``docs/benchmarks/``) and
``packages/*/README.md`` is one test, with id ``file:line`` (the line of the opening fence).

Rules the docs follow:

- **A file's blocks run in order in one namespace.** A block may use names that an earlier block
  of the same file defined (a reader reads them in order), nothing else: the test of block *k*
  runs, in a fresh namespace, every earlier block of its file that is not skipped, then block
  *k*. A failure in an earlier block is reported as such.
- Blocks run with the current directory set to a fresh temporary folder (files they write land
  there) and memopt's cache folder inside it. They run in this process, compiled with the
  markdown file as their file name and their own line numbers, so a traceback points at the doc.
- A block that cannot run on a CPU-only machine without network (it needs a CUDA GPU, a large
  download) says so on the line just before its fence::

      <!-- doc-test: skip: needs a CUDA GPU -->

  The test is then skipped with that reason, after checks that need no run: the block compiles,
  its imports work, and its calls of what it imports (and of methods of objects made from
  those) bind to today's signatures (:func:`signature_problems`). Any other ``doc-test``
  comment, or one that does not precede a python fence, fails.
- torch's warning that ``torch.distributed.checkpoint`` runs without a process group is not an
  error here (the DCP recipes run on every rank; here there is one process); every other
  warning is, as in all the tools' tests.
"""

from __future__ import annotations

import ast
import inspect
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^(\s*)```\s*(?:python3?|py)\s*$")  # also indented, in a list
MARKER = re.compile(r"<!--\s*doc-test\b(.*?)-->")
SKIP = re.compile(r"^:\s*skip:\s*(\S.*?)\s*$")
#: torch.distributed.checkpoint's notice when it saves or loads without a process group
SINGLE_PROCESS_DCP = "torch.distributed is disabled, unavailable or uninitialized"


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    code: str  # padded with blank lines so that line numbers are the markdown file's
    skip: str | None  # the reason, when marked

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT).as_posix()}:{self.line}"

    def compiled(self):
        return compile(self.code, str(self.path), "exec", dont_inherit=True)


def doc_files() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "packages").glob("*/README.md")),
    ]


def parse(path: Path, root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """The python blocks of one markdown file, and the problems with its doc-test markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    rel = path.relative_to(root).as_posix()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent = len(fence.group(1))
        start = i
        end = start + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            problems.append(f"{rel}:{start + 1}: python fence never closed")
        skip = None
        if start > 0 and (marker := MARKER.search(lines[start - 1])):
            reason = SKIP.match(marker.group(1))
            if reason is None:
                problems.append(
                    f"{rel}:{start}: unknown doc-test marker (want '<!-- doc-test: skip: WHY -->')"
                )
            else:
                skip = reason.group(1)
        body = [line[indent:] for line in lines[start + 1 : end]]
        code = "\n" * (start + 1) + "\n".join(body) + "\n"
        blocks.append(Block(path, start + 1, code, skip))
        i = end + 1
    fenced = {b.line - 1 for b in blocks}  # 1-based line of each marker's place
    for number, text in enumerate(lines, start=1):
        if MARKER.search(text) and number not in fenced:
            problems.append(
                f"{rel}:{number}: doc-test marker not on the line before a python fence"
            )
    return blocks, problems


def collect() -> tuple[list[Block], list[str]]:
    blocks: list[Block] = []
    problems: list[str] = []
    for path in doc_files():
        found, wrong = parse(path)
        blocks += found
        problems += wrong
    return blocks, problems


BLOCKS, PROBLEMS = collect()


def test_the_docs_have_examples_and_well_formed_markers() -> None:
    assert len(BLOCKS) >= 14, f"only {len(BLOCKS)} python blocks found under {ROOT}"
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_parser_finds_blocks_markers_and_lines(tmp_path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "# t\n```python\na = 1\n```\ntext\n<!-- doc-test: skip: needs a GPU -->\n"
        "```python\nb = a\n```\n```bash\nls\n```\n- item\n\n  ```py\n  c = 1\n  ```\n",
        encoding="utf-8",
    )
    blocks, problems = parse(doc, root=tmp_path)
    assert problems == []
    assert [(b.line, b.skip) for b in blocks] == [(2, None), (7, "needs a GPU"), (15, None)]
    assert blocks[1].code.splitlines()[7] == "b = a"  # line 8 of the file is line 8 of the code
    assert blocks[2].code.splitlines()[15] == "c = 1"


def signature_problems(block: Block) -> list[str]:
    """What a block that does not run can still be checked for: it imports, and its calls of
    what it imports (``Cls(...)``, ``f(...)``) and of the methods and attributes of objects it
    makes from them (``obj = Cls(...)`` then ``obj.method(...)``, ``obj.attr``) name
    parameters and attributes that exist, with arguments that bind."""
    tree = ast.parse(block.code, str(block.path))
    namespace: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            exec(compile(ast.Module([node], []), str(block.path), "exec"), namespace)
    made: dict[str, type] = {}  # variable -> the imported class it was made from
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and isinstance(namespace.get(node.value.func.id), type)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    made[target.id] = namespace[node.value.func.id]
    problems = []

    def bind(where: str, fn: object, node: ast.Call, *bound: object) -> None:
        if any(isinstance(a, ast.Starred) for a in node.args) or any(
            k.arg is None for k in node.keywords
        ):
            return
        try:
            sig = inspect.signature(fn)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        args = [*bound, *(object() for _ in node.args)]
        try:
            sig.bind(*args, **{k.arg: object() for k in node.keywords if k.arg})
        except TypeError as exc:
            problems.append(f"{block.path.name}:{node.lineno}: {where}: {exc}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            fn = namespace.get(node.func.id)
            if callable(fn):
                bind(node.func.id, fn, node)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in made
        ):
            cls = made[node.value.id]
            if not hasattr(cls, node.attr):
                problems.append(
                    f"{block.path.name}:{node.lineno}: {cls.__name__} has no attribute {node.attr!r}"
                )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id in made
        ):
            method = inspect.getattr_static(made[node.func.value.id], node.func.attr, None)
            if inspect.isfunction(method):
                bind(f"{node.func.value.id}.{node.func.attr}", method, node, object())
    return problems


def test_the_signature_check_finds_what_it_looks_for() -> None:
    code = (
        "from memopt_core import MemOptimizer\n"
        "opt = MemOptimizer([], rule='adamw', moment='q8')\n"
        "opt.step(1, 2)\n"
        "opt.no_such_method()\n"
        "opt.zero_grad(set_to_none=True)\n"
    )
    problems = signature_problems(Block(ROOT / "x.md", 1, code, "test"))
    assert len(problems) == 3, problems
    assert "moment" in problems[0]
    assert "no_such_method" in problems[1]
    assert "opt.step" in problems[2]


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_example_runs(block: Block, tmp_path, monkeypatch) -> None:
    code = block.compiled()  # a skipped block still has to be valid Python
    if block.skip is not None:
        problems = signature_problems(block)  # and name what exists
        assert not problems, "\n".join(problems)
        pytest.skip(f"{block.id}: {block.skip}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MEMOPT_CACHE_DIR", str(tmp_path / "memopt-cache"))
    torch.manual_seed(0)
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    with warnings.catch_warnings():
        # the DCP recipes run on every rank; here there is one process and no process group
        warnings.filterwarnings("ignore", SINGLE_PROCESS_DCP, UserWarning)
        for earlier in BLOCKS:
            if earlier.path != block.path or earlier.line >= block.line or earlier.skip:
                continue
            try:
                exec(earlier.compiled(), namespace)
            except Exception as exc:
                raise AssertionError(f"earlier block {earlier.id} failed: {exc!r}") from exc
        exec(code, namespace)
