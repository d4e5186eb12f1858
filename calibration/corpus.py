"""Sample data for calibration and accuracy checks.

The built-in corpus needs no download: English prose is taken at run time from
the docstrings of the Python standard library that runs kvq (parsed with `ast`,
never imported). Paragraphs are cleaned (code, doctests, parameter lists and
short fragments dropped), deduplicated, and assigned to the calibration or the
held-out evaluation part by a hash of their text, so the two parts never
overlap and the evaluation part does not move when the calibration seed does.

User data: `.txt` files (one document each), `.jsonl` files (a `text` field per
line), or a directory holding such files. Everything ends up as a list of
`Document(text, source)`; `token_windows` turns documents into fixed-length
token windows, shuffled deterministically by seed.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import random
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import InputError

BUILTIN = "builtin"
SPLITS = ("calibration", "evaluation")
# One paragraph in ten is held out for evaluation (chosen by text hash).
_EVAL_BUCKETS = 10
_MIN_WORDS = 8
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3"}
_CODE_MARKERS = (">>>", "...", "::", "$ ", "==", "->", "{", "}", "[", "]", "\\")
_FIELD_LIST = re.compile(r"^\s*(:\w+|\w+\s*:\s*$|Args:|Arguments:|Returns:|Raises:|Parameters|Example)", re.M)


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # where it came from: "json/__init__.py:dumps", "data.jsonl:17"


# ------------------------------------------------------------------ builtin
def _is_prose(par: str) -> bool:
    words = par.split()
    if len(words) < _MIN_WORDS or "." not in par:
        return False
    if any(m in par for m in _CODE_MARKERS) or _FIELD_LIST.search(par):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in par)
    return letters / len(par) >= 0.9


def _paragraphs(doc: str) -> list[str]:
    out = []
    for block in re.split(r"\n\s*\n", doc):
        lines = block.splitlines()
        # An indented block inside a docstring is a code or literal example.
        if not lines or any(ln.startswith((" ", "\t")) for ln in lines):
            continue
        par = " ".join(ln.strip() for ln in lines)
        if _is_prose(par):
            out.append(par)
    return out


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.relative_to(root).parts)))


@functools.lru_cache(maxsize=1)
def _builtin_documents() -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    parts: tuple[list[Document], list[Document]] = ([], [])
    for path in _stdlib_files():
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue  # a broken or unreadable stdlib file only costs us its prose
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                continue
            where = rel if isinstance(node, ast.Module) else f"{rel}:{node.name}"
            for par in _paragraphs(doc):
                if par in seen:
                    continue
                seen.add(par)
                digest = hashlib.sha256(par.encode()).digest()
                parts[digest[0] % _EVAL_BUCKETS == 0].append(Document(par, where))
    return tuple(parts[0]), tuple(parts[1])


def builtin_documents(split: str = "calibration") -> list[Document]:
    """Prose paragraphs from the running Python's stdlib docstrings, one split."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}")
    calib, held_out = _builtin_documents()
    docs = list(calib if split == "calibration" else held_out)
    if not docs:
        raise InputError(
            f"the built-in corpus is empty: no docstrings found under {sysconfig.get_paths()['stdlib']}; "
            "pass your own data with --dataset PATH (.txt, .jsonl or a directory)."
        )
    return docs


def builtin_description() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor} stdlib docstrings"


# ---------------------------------------------------------------- user data
def _read_text(path: Path, field: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"{field}: cannot read {path} as UTF-8 text ({e}); is it binary? Point {field} at "
                         ".txt/.jsonl text, or remove the file.") from None
    if "\x00" in text:  # valid UTF-8 can still be binary data (NUL bytes never occur in prose)
        raise InputError(f"{field}: {path} holds NUL bytes, so it is binary, not text; point {field} at "
                         ".txt/.jsonl text, or remove the file.")
    return text


def _jsonl_documents(path: Path, field: str) -> list[Document]:
    docs = []
    for n, line in enumerate(_read_text(path, field).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{field}: {path}:{n} is not valid JSON ({e.msg}); each line must be one JSON "
                             "object.") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise InputError(
                f"{field}: {path}:{n} has no string field 'text'; each line must look like {{\"text\": \"...\"}}."
            )
        if row["text"].strip():
            docs.append(Document(row["text"], f"{path.name}:{n}"))
    return docs


def user_documents(path: str | Path, field: str = "calibration.dataset") -> list[Document]:
    """Documents from a .txt file, a .jsonl file, or a directory of them (sorted). `field` names the
    recipe field / option the path came from, so every error says which setting to fix."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{field}: dataset {p} does not exist; pass 'builtin' or a .txt/.jsonl file or a directory.")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".jsonl"))
        if not files:
            raise InputError(f"{field}: directory {p} holds no .txt or .jsonl files; add some or pass 'builtin'.")
    elif p.suffix in (".txt", ".jsonl"):
        files = [p]
    else:
        raise InputError(f"{field}: dataset {p} must be a .txt or .jsonl file (or a directory of them), "
                         f"not {p.suffix!r}.")
    docs: list[Document] = []
    for f in files:
        if f.suffix == ".jsonl":
            docs.extend(_jsonl_documents(f, field))
        else:
            text = _read_text(f, field)
            if text.strip():
                docs.append(Document(text, f.name))
    if not docs:
        raise InputError(f"{field}: dataset {p} contains no text; add documents or pass 'builtin'.")
    return docs


def load_documents(dataset: str, split: str = "calibration", field: str = "calibration.dataset") -> list[Document]:
    """'builtin' (the given split) or a user path (used whole for either purpose)."""
    if dataset == BUILTIN:
        return builtin_documents(split)
    return user_documents(dataset, field)


# ------------------------------------------------------------ token windows
@dataclass(frozen=True)
class TokenWindows:
    ids: torch.Tensor  # [num_samples, seq_len] int64
    sources: list[list[str]]  # documents each window draws from
    total_tokens: int  # tokens available in the shuffled stream

    def describe(self) -> list[dict]:
        return [
            {"index": i, "sources": src, "sha256": hashlib.sha256(row.numpy().tobytes()).hexdigest()[:16]}
            for i, (row, src) in enumerate(zip(self.ids, self.sources))
        ]


def token_windows(tokenizer, docs: list[Document], num_samples: int, seq_len: int, seed: int,
                  field: str = "calibration.dataset") -> TokenWindows:
    """Shuffle documents by seed, tokenize them as one stream, cut `num_samples` windows.

    Windows are contiguous and disjoint. Too little text is an error rather than
    silently fewer or repeated samples: calibration statistics should describe
    exactly what the user asked for.
    """
    if num_samples < 1 or seq_len < 2:
        raise InputError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}.")
    order = list(docs)
    random.Random(seed).shuffle(order)
    need = num_samples * seq_len
    ids: list[int] = []
    owners: list[int] = []  # document index of every token, for provenance
    for d_idx, doc in enumerate(order):
        toks = tokenizer(doc.text + "\n\n", add_special_tokens=False)["input_ids"]
        ids.extend(toks)
        owners.extend([d_idx] * len(toks))
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise InputError(
            f"{field}: the data has {len(ids)} tokens but {num_samples} samples x {seq_len} tokens = {need} are "
            "needed; add more text, or ask for fewer tokens (num_samples / seq_len, perplexity_tokens)."
        )
    t = torch.tensor(ids[:need], dtype=torch.int64).view(num_samples, seq_len)
    sources = []
    for i in range(num_samples):
        used = sorted(set(owners[i * seq_len : (i + 1) * seq_len]))
        sources.append([order[j].source for j in used])
    return TokenWindows(t, sources, len(ids))
