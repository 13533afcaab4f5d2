"""Text DataModules: files, splits, tokenisation, padding, length limits, the offline BPE tokenizer."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from dplightning.data import E2EDataModule, SST2DataModule, TextFileDataModule
from dplightning.data.text import IGNORE, PadCollate
from dplightning.privacy.poisson import EmptySafeCollate

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
WORDS = "the cheap pub near the river serves italian food with a view of the city centre".split()


def _e2e_csv(path: Path, mrs: int = 30, refs: int = 3) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["mr", "ref"])
        for m in range(mrs):
            for r in range(refs):
                writer.writerow([f"name[Venue{m}], food[{WORDS[m % len(WORDS)]}]", " ".join(WORDS[r : r + 6 + m % 4])])
    return path


def _sst2(folder: Path) -> Path:
    folder.mkdir()
    for name, column, n in (("train.tsv", "sentence", 40), ("dev.tsv", "content", 10)):
        lines = ["label\t" + column] + [f"{i % 2}\t{' '.join(WORDS[: 3 + i % 9])}" for i in range(n)]
        (folder / name).write_text("\n".join(lines) + "\n")
    return folder


def test_e2e_single_csv_is_split_by_meaning_representation(tmp_path: Path) -> None:
    dm = E2EDataModule(str(_e2e_csv(tmp_path / "dev.csv")), vocab_size=300, tokenizer_dir=str(tmp_path / "tok"))
    splits = {s: dm.read(s) for s in ("train", "val", "test")}
    prompts = {s: {e.prompt for e in ex} for s, ex in splits.items()}
    assert sum(len(e) for e in splits.values()) == 90
    assert not (prompts["train"] & prompts["val"]) and not (prompts["train"] & prompts["test"])
    assert not (prompts["val"] & prompts["test"])


def test_causal_examples_mask_the_prompt_and_padding(tmp_path: Path) -> None:
    dm = E2EDataModule(str(_e2e_csv(tmp_path / "dev.csv")), vocab_size=300, tokenizer_dir=str(tmp_path / "tok"))
    dm.setup("fit")
    assert (tmp_path / "tok" / "tokenizer.json").exists()  # saved next to the run, reused on resume
    item = dm.splits["train"][0]
    prompt = len(item["prompt_ids"])
    assert item["labels"][:prompt] == [IGNORE] * prompt
    assert item["labels"][prompt:] == item["input_ids"][prompt:]
    assert item["input_ids"][-1] == dm.tokenizer.eos_token_id
    batch = PadCollate(dm.tokenizer.pad_token_id)(dm.splits["train"][:4])
    pad = batch["attention_mask"] == 0
    assert pad.any() and (batch["labels"][pad] == IGNORE).all()
    assert (batch["input_ids"][pad] == dm.tokenizer.pad_token_id).all()
    text = dm.tokenizer.decode(item["input_ids"][prompt:], skip_special_tokens=True)
    assert text.strip() in {" ".join(WORDS[r : r + 6 + m % 4]) for m in range(30) for r in range(3)}


def test_too_long_examples_are_an_error_or_dropped_never_truncated(tmp_path: Path) -> None:
    path, tok = str(_e2e_csv(tmp_path / "dev.csv")), str(tmp_path / "tok")
    whole = E2EDataModule(path, vocab_size=300, tokenizer_dir=tok, max_length=10_000)
    whole.setup("fit")
    lengths = sorted(len(e["input_ids"]) for e in whole.splits["train"])
    limit = lengths[len(lengths) // 2]
    with pytest.raises(ValueError, match=rf"longer than max_length={limit}.*too_long='drop'"):
        E2EDataModule(path, vocab_size=300, tokenizer_dir=tok, max_length=limit).setup("fit")
    dm = E2EDataModule(path, vocab_size=300, tokenizer_dir=tok, max_length=limit, too_long="drop")
    dm.setup("fit")
    kept = dm.splits["train"]
    assert len(kept) == sum(n <= limit for n in lengths) and all(len(e["input_ids"]) <= limit for e in kept)


def test_sst2_reads_glue_tsv_and_empty_poisson_batches_collate(tmp_path: Path) -> None:
    dm = SST2DataModule(str(_sst2(tmp_path / "sst2")), vocab_size=300, tokenizer_dir=str(tmp_path / "tok"))
    dm.setup("fit")
    assert len(dm.splits["train"]) == 40 and len(dm.splits["val"]) == 10
    assert [e["labels"] for e in dm.splits["train"][:4]] == [0, 1, 0, 1]
    empty = EmptySafeCollate(PadCollate(dm.tokenizer.pad_token_id), dm.splits["train"])([])
    assert empty["input_ids"].shape[0] == 0 and empty["labels"].shape == (0,)


def test_jsonl_prompt_completion_and_held_out_validation(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}:", "completion": " " + " ".join(WORDS[: i % 7 + 2])}) + "\n"
                            for i in range(60)))  # fmt: skip
    dm = TextFileDataModule(str(path), vocab_size=280, tokenizer_dir=str(tmp_path / "tok"))
    train, val = dm.read("train"), dm.read("val")
    assert len(train) + len(val) == 60 and len(val) == 3
    assert not {e.prompt for e in train} & {e.prompt for e in val}
    with pytest.raises(ValueError, match="'text' column or 'prompt' and 'completion'"):
        (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
        TextFileDataModule(str(tmp_path / "bad.jsonl")).read("train")


def test_trained_tokenizer_round_trips_any_bytes(tmp_path: Path) -> None:
    from dplightning.data.tokenizer import train_bpe

    tok = train_bpe([" ".join(WORDS)] * 20, 300, tmp_path)
    text = "naïve café — 東京 🙂"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: no unknown token
    assert tok.pad_token_id == 0 and tok.eos_token_id == 1


@pytest.mark.skipif(not (SHARED / "sst2" / "train.tsv").exists(), reason="SST-2 not in ../shared/data/sst2")
def test_real_sst2_files() -> None:
    dm = SST2DataModule(str(SHARED / "sst2"))
    train, dev = dm.read("train"), dm.read("val")
    assert (len(train), len(dev)) == (67349, 872)
    assert {e.label for e in train} == {0, 1} and all(e.text for e in dev)


@pytest.mark.skipif(not (SHARED / "e2e" / "devset.csv").exists(), reason="E2E not in ../shared/data/e2e")
def test_real_e2e_file_is_split_without_shared_mrs() -> None:
    dm = E2EDataModule(str(SHARED / "e2e" / "devset.csv"))
    sizes = {s: len(dm.read(s)) for s in ("train", "val", "test")}
    assert sum(sizes.values()) == 4672 and min(sizes.values()) > 300
    assert not {e.prompt for e in dm.read("train")} & {e.prompt for e in dm.read("test")}


def test_pad_collate_left_pads_nothing_and_keeps_order() -> None:
    batch = PadCollate(9)([{"input_ids": [1, 2, 3], "labels": 1}, {"input_ids": [4], "labels": 0}])
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 3], [4, 9, 9]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(batch["labels"], torch.tensor([1, 0]))


def test_a_tokenizer_fitted_on_the_private_split_is_declared_not_covered(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(WORDS[i % 5 : i % 5 + 6])}) + "\n" for i in range(40)))
    private, public = tmp_path / "private_tok", tmp_path / "public_tok"
    (tmp_path / "public.txt").write_text("\n".join(WORDS) + "\n")

    def declared(**kwargs) -> dict[str, str]:
        dm = TextFileDataModule(str(path), vocab_size=280, **kwargs)
        dm.setup("fit")
        assert dm.dp_privacy_unit.description == "one row of the training file"
        return dm.dp_not_covered

    fitted = declared(tokenizer_dir=str(private))
    assert "fitted on the private training split" in fitted["tokenizer"]
    assert declared(tokenizer_dir=str(private)) == fitted  # a resumed run reuses the folder, and the flag
    assert declared(tokenizer=str(private)) == fitted  # so does a run given that folder as its tokenizer
    assert declared(tokenizer_dir=str(public), tokenizer_corpus=str(tmp_path / "public.txt")) == {}
    assert declared(tokenizer=str(public)) == {}
    (private / "dplightning_provenance.json").unlink()  # a folder that does not say what it was fitted on
    assert "maybe the private split" in declared(tokenizer_dir=str(private))["tokenizer"]
