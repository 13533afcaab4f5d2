"""Text DataModules from local files: SST-2 (GLUE TSV), E2E (CSV ``mr,ref``), generic JSONL/CSV.

Tokenisation happens here, with the model's tokenizer (``tokenizer: <hub name or folder>``)
or, for models built from a config, a byte-level BPE trained on the training split and
saved next to the run. Batches are padded per batch; the privacy unit is one example
(one sentence, one ``mr,ref`` pair, one line), and no example is ever truncated silently:
an example longer than ``max_length`` is an error unless ``too_long="drop"`` is asked for.
A BPE trained here records what it was fitted on (``dplightning_provenance.json`` beside
it); one fitted on the private training split is declared in ``dp_not_covered``, so
checkpoints, ``privacy-report`` and ``privacy.json`` flag it.
"""

from __future__ import annotations

import csv
import json
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader

from dplightning._state import known
from dplightning.data.tokenizer import load_tokenizer, train_bpe
from dplightning.privacy.provenance import PrivacyUnit

TOKENIZER_PROVENANCE = "dplightning_provenance.json"
"""File beside a trained BPE that records what it was fitted on."""
PRETRAINED = "pretrained"
PUBLIC_CORPUS = "public corpus"
PRIVATE_SPLIT = "private training split"
UNKNOWN_FIT = "unknown"
"""What a tokenizer was fitted on; the last two are flagged as not covered by the guarantee."""

IGNORE = -100
"""Label of positions that carry no loss (padding, and the prompt of prompt/completion data)."""


@dataclass(frozen=True)
class Example:
    """One privacy unit: a labelled text, or a prompt and the completion the model learns."""

    text: str = ""
    label: int | None = None
    prompt: str = ""
    completion: str = ""


class PadCollate:
    """Pads a list of tokenised examples into a batch (a picklable class, for loader workers).

    ``input_ids`` become ``[B, T]`` with ``attention_mask``; token ``labels`` are padded with
    ``-100`` (no loss); an int ``labels`` becomes a ``[B]`` tensor; ``prompt_ids`` (for
    generation) become ``prompt_ids`` and ``prompt_mask``.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
        batch: dict[str, Tensor] = {}
        if items and "input_ids" in items[0]:
            batch["input_ids"], batch["attention_mask"] = _pad([i["input_ids"] for i in items], self.pad_id)
        if items and "labels" in items[0]:
            labels = [i["labels"] for i in items]
            if isinstance(labels[0], int):
                batch["labels"] = torch.tensor(labels, dtype=torch.long)
            else:
                batch["labels"] = _pad(labels, IGNORE)[0]
        if items and "prompt_ids" in items[0]:
            batch["prompt_ids"], batch["prompt_mask"] = _pad([i["prompt_ids"] for i in items], self.pad_id)
        return batch


def _pad(rows: Sequence[Sequence[int]], value: int) -> tuple[Tensor, Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), value, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, : len(r)] = 1
    return ids, mask


class TextDataModule(pl.LightningDataModule):
    """Base of the text DataModules: tokenizer, encoding, length checks and loaders.

    Args:
        tokenizer: Hub name or local folder of a pretrained tokenizer (the model's). ``None``
            trains a byte-level BPE of ``vocab_size`` tokens on the training split (or on
            ``tokenizer_corpus``) and saves it in ``tokenizer_dir``.
        vocab_size: Size of the trained BPE (the model config's ``vocab_size`` must be at least this).
        tokenizer_dir: Where the trained tokenizer is saved (default: ``<default_root_dir>/tokenizer``);
            an existing one there is reused, so a resumed run keeps its token ids.
        tokenizer_corpus: A public text file (one text per line) to train the BPE on instead of
            the private training split. A vocabulary fit to private text is a function of that
            text and is not covered by the DP guarantee; use this (or a pretrained tokenizer)
            for models that will be released.
        max_length: Longest example in tokens (at most the model's positions).
        too_long: ``"error"`` (default) or ``"drop"`` for examples longer than ``max_length``;
            dropping happens before sampling, so N counts the examples kept.
        batch_size: Expected batch size of the train loader (Poisson rate ``batch_size / N``).
        eval_batch_size: Batch size of the validation, test and predict loaders.
        train_limit: Use a random subset of this many training examples (public randomness).
        split_seed: Seed of the subset and of any split made here.
        num_workers: DataLoader workers.
    """

    task: ClassVar[Literal["classification", "lm"]]
    privacy_unit: ClassVar[str] = "one example of the training split"
    """What one privacy unit is, in words (checkpoints, ``privacy-report`` and exports say it)."""

    def __init__(
        self,
        tokenizer: str | None = None,
        vocab_size: int = 1024,
        tokenizer_dir: str | None = None,
        tokenizer_corpus: str | None = None,
        max_length: int = 128,
        too_long: Literal["error", "drop"] = "error",
        batch_size: int = 32,
        eval_batch_size: int = 64,
        train_limit: int | None = None,
        split_seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if too_long not in ("error", "drop"):
            raise ValueError(f"too_long must be 'error' or 'drop', got {too_long!r}.")
        self.tokenizer_name = tokenizer
        self.vocab_size = vocab_size
        self.tokenizer_dir = tokenizer_dir
        self.tokenizer_corpus = tokenizer_corpus
        self.max_length = max_length
        self.too_long = too_long
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.train_limit = train_limit
        self.split_seed = split_seed
        self.num_workers = num_workers
        self.tokenizer: Any = None
        self.tokenizer_fitted_on: str | None = None
        """What the tokenizer was fitted on (:data:`PRETRAINED`, ...); ``None`` until it is loaded."""
        self.splits: dict[str, list[dict[str, Any]]] = {}

    # ------------------------------------------------------------------ what a subclass provides

    def read(self, split: Literal["train", "val", "test"]) -> list[Example]:
        """The examples of ``split``, read from the local files."""
        raise NotImplementedError

    # ------------------------------------------------------------------ tokenizer

    def _tokenizer_folder(self) -> Path:
        if self.tokenizer_dir is not None:
            return Path(self.tokenizer_dir)
        root = self.trainer.default_root_dir if self.trainer is not None else "lightning_logs"
        return Path(root) / "tokenizer"

    def _fit_bpe(self, folder: Path) -> Any:
        """Train the BPE and record beside it what it was fitted on (a later run reusing the folder reads it)."""
        fitted_on = PUBLIC_CORPUS if self.tokenizer_corpus is not None else PRIVATE_SPLIT
        tokenizer = train_bpe(self._training_texts(), self.vocab_size, folder)
        (folder / TOKENIZER_PROVENANCE).write_text(json.dumps({"fitted_on": fitted_on}) + "\n", encoding="utf-8")
        return tokenizer

    def _training_texts(self) -> list[str]:
        if self.tokenizer_corpus is not None:
            return Path(self.tokenizer_corpus).read_text(encoding="utf-8").splitlines()
        rank_zero_warn(
            "Training the BPE tokenizer on the private training split: its vocabulary is not covered by the DP "
            "guarantee. For a model you will release, pass a pretrained `tokenizer` or a public `tokenizer_corpus`."
        )
        return [e.text or e.prompt + " " + e.completion for e in self._train_examples()]

    def prepare_data(self) -> None:
        if self.tokenizer_name is None and not (self._tokenizer_folder() / "tokenizer.json").exists():
            self._fit_bpe(self._tokenizer_folder())

    def _load_tokenizer(self) -> Any:
        if self.tokenizer_name is not None:
            self.tokenizer_fitted_on = _recorded_fit(Path(self.tokenizer_name)) or PRETRAINED
            return load_tokenizer(self.tokenizer_name)
        folder = self._tokenizer_folder()
        if not (folder / "tokenizer.json").exists():  # setup() without prepare_data(): one process
            tokenizer = self._fit_bpe(folder)
        else:
            rank_zero_info(f"Using the tokenizer saved in {folder}.")
            tokenizer = load_tokenizer(str(folder))
        self.tokenizer_fitted_on = _recorded_fit(folder) or UNKNOWN_FIT
        return tokenizer

    # ------------------------------------------------------------------ what the guarantee is about

    @property
    def dp_privacy_unit(self) -> PrivacyUnit:
        """One example of the training split (:attr:`privacy_unit`)."""
        return PrivacyUnit(self.privacy_unit)

    @property
    def dp_not_covered(self) -> dict[str, str]:
        """The tokenizer, when it was (or may have been) fitted on the private training split."""
        if self.tokenizer_fitted_on == PRIVATE_SPLIT:
            return {"tokenizer": "a byte-level BPE vocabulary fitted on the private training split"}
        if self.tokenizer_fitted_on == UNKNOWN_FIT:
            reused = "a BPE reused from a folder that does not record what it was fitted on (maybe the private split)"
            return {"tokenizer": reused}
        return {}

    # ------------------------------------------------------------------ encoding

    def _train_examples(self) -> list[Example]:
        examples = self.read("train")
        if self.train_limit is not None and self.train_limit < len(examples):
            examples = random.Random(self.split_seed).sample(examples, self.train_limit)
        return examples

    def encode(self, example: Example) -> dict[str, Any]:
        """Token ids of one example: ``input_ids`` and ``labels`` (an int, or ids with -100 on the prompt)."""
        tok = self.tokenizer
        if self.task == "classification":
            known(example.label, "the example's label")
            return {"input_ids": tok(example.text)["input_ids"], "labels": int(example.label)}
        eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
        prompt = tok(example.prompt, add_special_tokens=False)["input_ids"] if example.prompt else []
        target = tok(example.completion or example.text, add_special_tokens=False)["input_ids"] + eos
        return {"input_ids": prompt + target, "labels": [IGNORE] * len(prompt) + target, "prompt_ids": prompt}

    def _encode_split(self, split: Literal["train", "val", "test"]) -> list[dict[str, Any]]:
        examples = self._train_examples() if split == "train" else self.read(split)
        encoded = [self.encode(e) for e in examples]
        long = [i for i, e in enumerate(encoded) if len(e["input_ids"]) > self.max_length]
        if long and self.too_long == "error":
            worst = max(len(encoded[i]["input_ids"]) for i in long)
            raise ValueError(
                f"{len(long)} {split} examples are longer than max_length={self.max_length} tokens (the longest "
                f"has {worst}; first index {long[0]}). Truncating would silently change the privacy unit: raise "
                "max_length (up to the model's positions) or pass too_long='drop' to leave them out before sampling."
            )
        if long:
            rank_zero_info(f"Dropped {len(long)} of {len(encoded)} {split} examples longer than {self.max_length}.")
            keep = set(range(len(encoded))) - set(long)
            encoded = [e for i, e in enumerate(encoded) if i in keep]
        if not encoded:
            raise ValueError(f"The {split} split is empty.")
        return encoded

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is None:
            self.tokenizer = self._load_tokenizer()
        wanted = {"fit": ["train", "val"], "validate": ["val"], "test": ["test"], "predict": ["test"]}
        for split in wanted.get(stage or "", ["train", "val", "test"]):
            if split not in self.splits:
                self.splits[split] = self._encode_split(split)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ loaders

    def _loader(self, data: list[dict[str, Any]], batch_size: int, shuffle: bool = False) -> DataLoader:
        return DataLoader(
            data,  # type: ignore[arg-type]
            batch_size=batch_size,
            shuffle=shuffle,
            collate_fn=PadCollate(self.tokenizer.pad_token_id),
            num_workers=self.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.splits["train"], self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.splits["val"], self.eval_batch_size)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.splits["test"], self.eval_batch_size)

    def predict_dataloader(self) -> DataLoader:
        """Test prompts, each distinct prompt once (for generation), or the test texts."""
        if self.task == "lm":
            seen: dict[tuple[int, ...], dict[str, Any]] = {}
            for e in self.splits["test"]:
                seen.setdefault(tuple(e["prompt_ids"]), {"prompt_ids": e["prompt_ids"]})
            return self._loader(list(seen.values()), self.eval_batch_size)
        return self.test_dataloader()


def _recorded_fit(folder: Path) -> str | None:
    """What the BPE in ``folder`` was fitted on, as :meth:`TextDataModule._fit_bpe` recorded it."""
    record = folder / TOKENIZER_PROVENANCE
    if not record.is_file():
        return None
    return str(json.loads(record.read_text(encoding="utf-8"))["fitted_on"])


def _read_rows(path: str | Path) -> list[dict[str, str]]:
    """Rows of a CSV, TSV or JSONL file as dicts."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"No data file at {path}.")
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    with path.open(encoding="utf-8", newline="") as f:
        dialect = "excel-tab" if path.suffix == ".tsv" else "excel"
        return list(csv.DictReader(f, dialect=dialect, quoting=csv.QUOTE_NONE if dialect == "excel-tab" else 0))


class SST2DataModule(TextDataModule):
    """GLUE SST-2 sentiment from a folder with ``train.tsv`` and ``dev.tsv`` (``label`` and text columns).

    GLUE's test labels are not public, so ``dev.tsv`` serves as validation and test split,
    as in the DP fine-tuning literature. The privacy unit is one training sentence.

    Args:
        path: Folder with the two TSV files.
        **kwargs: See :class:`TextDataModule`.
    """

    task = "classification"
    privacy_unit = "one training sentence"

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def read(self, split: Literal["train", "val", "test"]) -> list[Example]:
        rows = _read_rows(Path(self.path) / ("train.tsv" if split == "train" else "dev.tsv"))
        text = next((c for c in ("sentence", "content", "text") if rows and c in rows[0]), None)
        if text is None or "label" not in rows[0]:
            raise ValueError(f"{self.path}: expected a 'label' column and a 'sentence' (or 'content') column.")
        return [Example(text=r[text], label=int(r["label"])) for r in rows]


class E2EDataModule(TextDataModule):
    """E2E table-to-text: ``mr`` (meaning representation) -> ``ref`` (a human reference).

    ``path`` is a folder with ``trainset.csv``, ``devset.csv`` and ``testset_w_refs.csv`` (the
    official splits), or a single CSV, split here by meaning representation (80/10/10,
    ``split_seed``) so that no MR is in two splits. The prompt ``"<mr> ="`` is masked out of
    the loss. The privacy unit is one ``(mr, ref)`` row; an MR has several rows (references).

    Args:
        path: Folder with the official CSVs, or one CSV with columns ``mr,ref``.
        **kwargs: See :class:`TextDataModule`.
    """

    task = "lm"
    privacy_unit = "one (mr, ref) row of the training split (an MR with several references is several units)"
    files: ClassVar[dict[str, str]] = {"train": "trainset.csv", "val": "devset.csv", "test": "testset_w_refs.csv"}

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path

    def read(self, split: Literal["train", "val", "test"]) -> list[Example]:
        folder = Path(self.path)
        if folder.is_dir() and all((folder / f).exists() for f in self.files.values()):
            rows = _read_rows(folder / self.files[split])
        else:
            rows = self._split_by_mr(_read_rows(folder), split)
        return [Example(prompt=f"{r['mr']} =", completion=" " + r["ref"]) for r in rows]

    def _split_by_mr(self, rows: list[dict[str, str]], split: str) -> list[dict[str, str]]:
        mrs = sorted({r["mr"] for r in rows})
        random.Random(self.split_seed).shuffle(mrs)
        n_val = n_test = max(1, len(mrs) // 10)
        chosen = {"test": mrs[:n_test], "val": mrs[n_test : n_test + n_val], "train": mrs[n_test + n_val :]}[split]
        keep = set(chosen)
        return [r for r in rows if r["mr"] in keep]


class TextFileDataModule(TextDataModule):
    """Language modelling on local JSONL or CSV files with a ``text`` column or ``prompt``/``completion`` columns.

    With ``prompt``/``completion`` the prompt is masked out of the loss. The privacy unit
    is one row of ``train``.

    Args:
        train: Training file (``.jsonl`` or ``.csv``).
        val: Validation file (default: 5% of ``train``, held out by ``split_seed``).
        test: Test file (default: the validation data).
        **kwargs: See :class:`TextDataModule`.
    """

    task = "lm"
    privacy_unit = "one row of the training file"

    def __init__(self, train: str, val: str | None = None, test: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.files = {"train": train, "val": val, "test": test or val}

    def _examples(self, path: str) -> list[Example]:
        rows = _read_rows(path)
        if rows and "text" in rows[0]:
            return [Example(text=r["text"]) for r in rows]
        if rows and {"prompt", "completion"} <= set(rows[0]):
            return [Example(prompt=r["prompt"], completion=r["completion"]) for r in rows]
        raise ValueError(f"{path}: expected a 'text' column or 'prompt' and 'completion' columns.")

    def read(self, split: Literal["train", "val", "test"]) -> list[Example]:
        if split != "train" and self.files[split] is not None:
            return self._examples(os.fspath(self.files[split]))
        examples = self._examples(self.files["train"])
        if self.files["val"] is not None:
            return examples
        order = list(range(len(examples)))
        random.Random(self.split_seed).shuffle(order)
        held = set(order[: max(1, len(examples) // 20)])
        return [e for i, e in enumerate(examples) if (i in held) == (split != "train")]
