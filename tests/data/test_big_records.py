"""Memory bounded by max_length, not by the record.

One 100 MB JSONL record used to drive preflight past 8 GiB RSS before any rank started: the
whole record was tokenised (~170 bytes of RSS per character) before truncation kept 2048
tokens of it. A long sample is now tokenised in bounded pieces, as far as its truncation
policy needs (shardwise.data.tokenize.LONG_CHARS), and a JSONL file is read a line at a time.
The pieces give the tokens whole-text tokenisation gives: checked here against it, record by
record, for every policy, on three kinds of tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sft_records import chat

import shardwise.data.tokenize as tokenize
from shardwise.config.data import DataConfig
from shardwise.data import build_dataset, sample_data_path
from shardwise.data.formats import Example
from shardwise.data.tokenize import Encoder, EncodeStats
from shardwise.errors import ShardwiseError

GIB = 1 << 30
PHRASE = "the quick brown fox jumps over the lazy dog; "  # 45 characters
PIECES = ["mountain", "river", " ", "  ", "\n", "naïve", "日本語", "🙂", "<|end|>", "<|bos|>", "x" * 50, "==", "12345",
          "\t", "a", "\u2028"]  # fmt: skip


def write_big_record(path: Path, role: str, repeats: int) -> Path:
    """A chat record whose `role` turn is PHRASE * repeats, written in pieces (the test process
    never holds it), after a short record on line 1."""
    with path.open("w") as f:
        f.write(json.dumps(chat("hi there", "ok")) + "\n")
        f.write('{"messages": [{"role": "user", "content": "' if role == "user" else
                '{"messages": [{"role": "user", "content": "write"}, {"role": "assistant", "content": "')
        chunk = PHRASE * 10_000
        for _ in range(repeats // 10_000):
            f.write(chunk)
        f.write(PHRASE * (repeats % 10_000))
        if role == "user":
            f.write('"}, {"role": "assistant", "content": "fine."}]}\n')
        else:
            f.write('"}]}\n')
    return path


CHILD = textwrap.dedent("""
    import json, sys
    from shardwise.run import run_spec
    from shardwise.config.schema import TrainConfig
    from shardwise.train.sft_data import prepare_sft
    from shardwise.data import load_dataset

    def peak_rss():
        # VmHWM: this address space's high-water mark. Not ru_maxrss, which Linux carries over
        # from the image before exec: a pytest worker grown past 1 GiB would be reported instead.
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    raw = json.loads(sys.argv[1])
    run = run_spec(TrainConfig.model_validate(raw), 1, "cpu")
    before = peak_rss()  # imports: the floor
    cache = prepare_sft(run)  # what preflight does with the data: tokenise once into the cache
    peak = peak_rss()
    ds = load_dataset(cache)
    docs = [ds.document(i) for i in range(ds.num_documents)]
    print(json.dumps({"before": before, "peak": peak, "stats": ds.stats.summary(),
                      "lengths": ds.stats.encode.lengths,
                      "docs": [[a.tolist(), b.tolist()] for a, b in docs]}))
""")


def prepare_in_child(tmp_path: Path, data: Path, **sft) -> dict:
    raw = {"model": {"name": "tiny-llama"}, "precision": "fp32",
           "data": {"sft": {"train_files": [str(data)], "max_length": 2048, **sft}},
           "run": {"device": "cpu", "nproc": 1}, "checkpointing": {"output_dir": str(tmp_path / "out")}}  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(raw)], capture_output=True, text=True,
                       timeout=300, check=False, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def reference(tok, data: Path, **sft) -> list:
    """Documents of the whole-text tokenisation (no pieces) of `data`."""
    old = tokenize.LONG_CHARS
    tokenize.LONG_CHARS = 1 << 60
    try:
        ds = build_dataset(DataConfig(train_files=[str(data)], max_length=2048, **sft), tok)
    finally:
        tokenize.LONG_CHARS = old
    return [[a.tolist(), b.tolist()] for a, b in (ds.document(i) for i in range(ds.num_documents))]


@pytest.mark.parametrize("role, truncation", [("assistant", "keep_start"), ("user", "cut_prompt")])
def test_a_100_mb_record_is_prepared_under_1_gib_rss(tmp_path, tok, role, truncation):
    """The reproduction: one 100 MB record through preflight's data step (prepare_sft) in a
    fresh process, peak RSS read from the process itself. It used to be OOM-killed at a 3 GiB
    cgroup limit (1.9 GiB for a 10 MB record); now ~0.55-0.65 GiB, with the imports' ~0.26."""
    repeats = 100_000_000 // len(PHRASE)
    big = write_big_record(tmp_path / "big.jsonl", role, repeats)
    assert big.stat().st_size > 100_000_000
    out = prepare_in_child(tmp_path, big, truncation=truncation)
    assert out["peak"] < GIB, f"peak RSS {out['peak'] / GIB:.2f} GiB (imports: {out['before'] / GIB:.2f} GiB)"
    assert "truncated 1" in out["stats"] and "2 samples" in out["stats"], out["stats"]
    assert len(out["docs"][1][0]) == 2048 and out["lengths"][1] > 2048  # the histogram's "over" bin
    # The kept tokens are those of whole-text tokenisation: the same record at 20,000 phrases
    # (900 kB), which starts and ends the same way, tokenised whole, keeps exactly them.
    small = write_big_record(tmp_path / "small.jsonl", role, 20_000)
    assert out["docs"] == reference(tok, small, truncation=truncation)
    ids, target = out["docs"][1]
    if truncation == "cut_prompt":  # the reply survives whole, after the BOS and the prompt's end
        assert ids[0] == tok.bos_token_id
        assert tok.decode([t for t, m in zip(ids, target, strict=True) if m]) == "fine." + tok.eos_token
    else:
        start = target.index(True)  # the reply starts after a short prompt and fills the rest
        assert 0 < start < 12 and all(target[start:])


# ------------------------------------------------------------------ same tokens as whole-text


def make_tokenizer(kind: str, tok):
    """The bundled byte-level BPE, or a Unigram (Metaspace, SentencePiece-like) or WordPiece
    (BERT pre-tokenizer) one trained offline on the bundled data."""
    if kind == "bpe":
        return tok
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|bos|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "[UNK]"]
    if kind == "unigram":
        t = Tokenizer(models.Unigram())
        t.normalizer, t.pre_tokenizer, t.decoder = normalizers.NFKC(), pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=600, special_tokens=special, unk_token="[UNK]")
    else:
        t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        t.normalizer, t.pre_tokenizer = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
        t.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=special)
    corpus = sample_data_path().read_text().splitlines() + ["naïve 日本語 🙂 == mountain river"] * 5
    t.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", unk_token="[UNK]")  # fmt: skip


def long_examples(seed: int = 0) -> list[Example]:
    """Records of every shape a long turn can take: a long prompt, reply, middle reply,
    system turn, many turns, plain text; from a few hundred to 40k characters of words,
    whitespace runs, multi-byte characters and special-token text."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        out, size = [], 0
        while size < n:
            out.append(rng.choice(PIECES) + (" " if rng.random() < 0.6 else ""))
            size += len(out[-1])
        return "".join(out)[:n]

    def m(*turns):
        return tuple({"role": r, "content": c} for r, c in turns)

    out = []
    for n in (300, 3000, 40_000):
        out += [Example(f"f:{n}:text", "text", text=text(n)),
                Example(f"f:{n}:user", "chat", messages=m(("user", text(n)), ("assistant", text(20)))),
                Example(f"f:{n}:reply", "chat", messages=m(("user", text(10)), ("assistant", text(n)))),
                Example(f"f:{n}:mid", "chat", messages=m(("user", text(10)), ("assistant", text(n)),
                                                          ("user", text(30)), ("assistant", text(15)))),
                Example(f"f:{n}:system", "chat", messages=m(("system", text(n)), ("user", text(n // 2)),
                                                             ("assistant", text(n // 3)))),
                Example(f"f:{n}:multi", "chat",
                        messages=m(*[t for _ in range(6) for t in (("user", text(n // 6)), ("assistant", text(n // 9)))]))]  # fmt: skip
    return out


def encode_all(tok, cfg: DataConfig, examples: list[Example], *, pieces: bool, monkeypatch) -> tuple:
    """(per example: samples or the error, stats without lengths, lengths). `pieces`: every
    sample over 4 * max_length characters goes through the bounded path, in windows of 16
    characters (the smallest windows: the hardest case for stability); else none does."""
    monkeypatch.setattr(tokenize, "LONG_CHARS", 0 if pieces else 1 << 60)
    monkeypatch.setattr(tokenize, "WINDOW_CHARS", 16 if pieces else 1 << 14)
    stats, out = EncodeStats(), []
    for ex in examples:
        try:
            out.append([(s.ids.tolist(), s.target.tolist()) for s in Encoder(tok, cfg).encode([ex], stats)])
        except ShardwiseError as exc:
            out.append(str(exc))
    lengths = stats.lengths
    stats.lengths = []
    return out, stats, lengths


@pytest.mark.parametrize("kind", ["bpe", "unigram", "wordpiece"])
def test_pieces_give_the_tokens_of_whole_text_tokenisation(tok, kind, monkeypatch):
    """Every policy, with and without train_on_prompt and add_eos: the same samples, masks,
    counts and errors whether a long sample is tokenised whole or in pieces; the recorded
    length is exact, or over max_length on both sides (a lower bound in pieces)."""
    t = make_tokenizer(kind, tok)
    examples = long_examples()
    bounded = 0
    for max_length in (16, 300):
        for truncation in ("keep_start", "cut_prompt", "drop", "raise"):
            for train_on_prompt, add_eos in ((False, True), (True, True), (False, False)):
                cfg = DataConfig(train_files=["unused"], max_length=max_length, truncation=truncation,
                                 train_on_prompt=train_on_prompt, add_eos=add_eos, on_error="skip")  # fmt: skip
                whole, s_whole, l_whole = encode_all(t, cfg, examples, pieces=False, monkeypatch=monkeypatch)
                cut, s_cut, l_cut = encode_all(t, cfg, examples, pieces=True, monkeypatch=monkeypatch)
                what = f"{kind} max_length={max_length} {truncation} train_on_prompt={train_on_prompt}"
                for ex, a, b in zip(examples, whole, cut, strict=True):
                    if isinstance(a, str) and a != b:  # raise: in pieces the exact length is not known
                        n = int(re.search(r"sample is (\d+) tokens", a).group(1))
                        assert n > max_length and b == a.replace(f"is {n} tokens", f"is more than {max_length} tokens")
                        continue
                    assert a == b, f"{what}: {ex.where}"
                assert s_whole == s_cut, what
                assert all(a == b or (a > max_length and b > max_length) for a, b in zip(l_whole, l_cut, strict=True))
                bounded += sum(a != b for a, b in zip(l_whole, l_cut, strict=True))
    assert bounded > 100  # the pieces were used, and stopped early: lengths are lower bounds there


def test_normal_records_take_the_whole_text_path_unchanged(tok, monkeypatch):
    """The bundled data (400 normal records) with the default thresholds never needs pieces;
    forced through them (nearly every sample, 16-character windows) it gives the same dataset."""
    cfg = DataConfig(train_files=[str(sample_data_path())], max_length=24, on_error="skip")
    calls = []
    real = Encoder._encode_long

    def counted(self, *a):
        calls.append(a[0].where)
        return real(self, *a)

    monkeypatch.setattr(Encoder, "_encode_long", counted)
    build_dataset(cfg, tok)
    assert calls == []
    monkeypatch.setattr(tokenize, "WINDOW_CHARS", 16)
    # over 4 * max_length characters is "long": nearly every record
    for truncation, max_length, train_on_prompt in (("cut_prompt", 8, False), ("cut_prompt", 24, False),
                                                    ("keep_start", 8, True), ("keep_start", 24, False)):
        c = cfg.model_copy(update={"truncation": truncation, "max_length": max_length,
                                   "train_on_prompt": train_on_prompt})
        monkeypatch.setattr(tokenize, "LONG_CHARS", 1 << 60)
        whole = build_dataset(c, tok)
        monkeypatch.setattr(tokenize, "LONG_CHARS", 0)
        calls.clear()
        cut = build_dataset(c, tok)
        assert len(calls) > 300 and whole.stats.encode.truncated > 250
        assert cut.stats.summary() == whole.stats.summary() and cut.num_documents == whole.num_documents
        for i in range(whole.num_documents):
            assert cut.document(i)[0].tolist() == whole.document(i)[0].tolist(), whole.where[i]
            assert cut.document(i)[1].tolist() == whole.document(i)[1].tolist(), whole.where[i]


def test_a_long_record_over_max_length_with_raise_names_file_and_line(tok, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps(chat("hi", "ok")) + "\n" + json.dumps(chat("q", PHRASE * 5000)) + "\n")
    with pytest.raises(ShardwiseError, match=r"data\.jsonl:2: field 'messages': sample is more than 64 tokens, "
                                             r"longer than max_length=64 \(data\.truncation='raise'"):
        build_dataset(DataConfig(train_files=[str(data)], max_length=64, truncation="raise"), tok)
    ds = build_dataset(DataConfig(train_files=[str(data)], max_length=64, truncation="drop"), tok)
    assert ds.num_documents == 1 and ds.stats.encode.dropped_too_long == 1
