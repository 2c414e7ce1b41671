"""Tests of the documentation (README.md, csrc/README.md, benchmarks/README.md, docs/): every relative link
and every repository path it names exists, and the README's Python snippets run.

A path is a backticked file name with a known extension, or a folder written with its trailing "/" (a bare
`a/b` is a metric name). It exists when it resolves against the repository root or the page's folder, or ends
a tracked path (`cuda/row_kernel.cuh` beside the name of its folder); `file.py::name` also needs `name` defined
in the file. Placeholders (`<op>/<op>.h`, `common/checks.*`, `$OUT/...`) are not paths, and a git-ignored one
(`examples/out/metrics.csv`) is an output, not checked.
"""
import fnmatch
import re
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import label_log_probs64

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted({ROOT / "README.md", ROOT / "csrc" / "README.md", ROOT / "benchmarks" / "README.md",
                *(ROOT / "docs").rglob("*.md")})
EXTENSIONS = {"py", "md", "h", "cpp", "cu", "cuh", "sh", "json", "txt", "toml", "csv", "png", "pyi", "yaml"}
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`]+)`")  # inline code, which may run over a line break
PATH = re.compile(r"[\w.-]+(/[\w.-]+)*/?(::\w+)?")


def _page_id(page):
    return str(page.relative_to(ROOT))


def _in_checkout():
    return subprocess.run(["git", "rev-parse", "--git-dir"], cwd=ROOT, capture_output=True).returncode == 0


def _ignore_patterns():
    lines = (ROOT / ".gitignore").read_text().splitlines() if (ROOT / ".gitignore").exists() else []
    return [line.strip().strip("/") for line in lines if line.strip() and not line.startswith("#")]


def _ignored_by_patterns(relative):
    parts = Path(relative).parts
    return any(fnmatch.fnmatch(part, pattern) or fnmatch.fnmatch("/".join(parts[:i + 1]), pattern)
               for pattern in _ignore_patterns() for i, part in enumerate(parts))


def _tracked_files():
    """The repository's files: git's list in a checkout, else every file but the ignored ones (a copy of the
    tree without its .git, as on a test machine)."""
    if _in_checkout():
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return set(out.split())
    files = (str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file())
    return {f for f in files if not f.startswith(".git/") and not _ignored_by_patterns(f)}


def _ignored(relative):
    """A git-ignored path (a build or run output, the virtual environment): generated, not in the tree."""
    if _in_checkout():
        return subprocess.run(["git", "check-ignore", "-q", relative], cwd=ROOT).returncode == 0
    return _ignored_by_patterns(relative)


def _path_of(token):
    """The repository path a backticked token names (without its `::name`), or None where it names none: a
    file with a known extension, or a folder written with its trailing "/" (`a/b` alone is a metric name)."""
    if not PATH.fullmatch(token):
        return None
    path = token.split("::")[0]
    if path.endswith("/") or re.fullmatch(rf"[\w-][\w.-]*\.({'|'.join(EXTENSIONS)})", path.rsplit("/", 1)[-1]):
        return path
    return None


def _missing_paths(page, text, tracked):
    """The backticked paths of `text` (a page's prose, code blocks left out) that name nothing in the tree."""
    missing = []
    for token in CODE.findall(FENCE.sub("", text)):
        path = _path_of(token.strip())
        if path is None:
            continue
        found = [p for p in (ROOT / path, page.parent / path) if p.exists()]
        found += [ROOT / f for f in tracked if ("/" + f).endswith("/" + path)]
        in_tree = found or path.endswith("/") and any("/" + path in "/" + f for f in tracked)
        if not in_tree and not _ignored(path):
            missing.append(token.strip())
            continue
        symbol = token.strip().partition("::")[2]
        if symbol and not any(p.is_file() and re.search(rf"^\s*(def|class) {symbol}\b", p.read_text(), re.M)
                              for p in found):
            missing.append(token.strip())
    return missing


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_exist(page):
    text = page.read_text()
    broken = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path) if path else page
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.is_file():
            headings = re.findall(r"^#+\s+(.*)$", resolved.read_text(), re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            if anchor not in slugs:
                broken.append(target)
    assert not broken, f"{_page_id(page)} links to what does not exist: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_paths_exist(page):
    missing = _missing_paths(page, page.read_text(), _tracked_files())
    assert not missing, f"{_page_id(page)} names paths that do not exist: {missing}"


def test_path_check_catches_a_missing_path():
    # The check itself: a renamed file, a removed test, a missing folder; placeholders, outputs, metric names
    # and dotted Python names are not paths.
    text = ("`tests/test_docs.py` `tests/test_gone.py` `tests/test_docs.py::test_named_paths_exist` "
            "`tests/test_docs.py::test_gone` `helpers.py` `gone.py` `cuda/row_kernel.cuh` `csrc/gone/` `linear/` "
            "`<op>/<op>.h` `$OUT/bench.json` `examples/out/metrics.csv` `clip_ratio/low_mean` "
            "`rl_losses.cross_entropy`")
    assert _missing_paths(ROOT / "README.md", text, _tracked_files()) == [
        "tests/test_gone.py", "tests/test_docs.py::test_gone", "gone.py", "csrc/gone/"]


# ---- the README's Python snippets ---------------------------------------------------------------------------
def _readme_snippets():
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)
    assert blocks, "the README has no Python snippet"
    return blocks


def _tour_inputs(device):
    """Small inputs under the names the README's snippets use but do not define (the API tour's tensors)."""
    n, vocab, hidden_size, docs = 24, 50, 16, 4
    leaf = torch.randn(n, vocab, device=device, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), device=device)
    labels[::5] = -100
    document_index = torch.arange(n, device=device) * docs // n
    old = (label_log_probs64(leaf, labels) + 0.1 * torch.randn(n, device=device, dtype=torch.float64)).float()
    adv = torch.randn(n, device=device)
    return {
        "logits": leaf, "logits_shard": leaf, "tp": None, "sdp": None,  # no group: one process holds it all
        "labels": labels, "advantages": adv, "adv": adv, "old_log_probs": old, "old": old,
        "ref": old - 0.05, "document_index": document_index, "doc": document_index,
        "rollouts": [(torch.tensor([1, 2, 3]), torch.tensor([4, 5]), 0.5),
                     (torch.tensor([6]), torch.tensor([7]), -1.0)],  # (prompt ids, completion ids, advantage)
        "hidden": torch.randn(n, hidden_size, device=device, requires_grad=True),
        "lm_head": torch.nn.Linear(hidden_size, vocab, bias=False, device=device),
    }


@pytest.mark.parametrize("index", range(len(_readme_snippets())))
def test_readme_snippet_runs(index, device):
    code = _readme_snippets()[index]
    if device == "cpu":
        code = code.replace('"cuda"', '"cpu"')
    namespace = _tour_inputs(device)
    exec(compile(code, f"README.md snippet {index}", "exec"), namespace)
