"""Build the bundled sample SFT dataset and the offline tokenizer, deterministically.

    python scripts/make_assets.py [OUT]  # rewrites OUT/{data,tokenizer}, default src/shardwise/assets

Everything is generated here (no downloads): small arithmetic, unit, word and list tasks as
single- and multi-turn chats and alpaca records; then a byte-level BPE trained on that text.
Running it twice gives byte-identical files (checked by tests/data/test_assets.py).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "src" / "shardwise" / "assets"
SEED = 20240601
N_CHAT, N_ALPACA = 240, 160
VOCAB = 2048
SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

WORDS = ["apple", "banana", "cherry", "river", "mountain", "window", "garden", "pencil", "rocket", "silver", "planet", "yellow", "orange", "forest", "butter", "candle", "dragon", "engine", "falcon", "guitar", "harbor", "island", "jacket", "kettle", "lemon", "marble", "needle", "ocean", "pepper", "quartz", "saddle", "tunnel", "violin", "walnut", "zebra", "anchor", "bridge", "castle"]
UNITS = [("kilometres", "metres", 1000), ("hours", "minutes", 60), ("minutes", "seconds", 60),
         ("kilograms", "grams", 1000), ("metres", "centimetres", 100), ("days", "hours", 24)]
ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
SYSTEMS = ["You are a concise assistant.", "Answer in one short sentence.",
           "You are a careful tutor who shows the result plainly.", "Reply politely and briefly."]


def words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))


def task(rng: random.Random) -> tuple[str, str, str, str]:
    """(instruction, input, question as one sentence, answer) for one random small task."""
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return "Add the two numbers.", f"{a} and {b}", f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return "Multiply the two numbers.", f"{a} and {b}", f"What is {a} times {b}?", f"{a} × {b} = {a * b}."
    if kind == 2:
        big, small, f = rng.choice(UNITS)
        n = rng.randint(2, 12)
        return (f"Convert {big} to {small}.", f"{n} {big}", f"How many {small} are in {n} {big}?",
                f"{n} {big} is {n * f} {small}.")
    if kind == 3:
        w = rng.choice(WORDS)
        return "Reverse the word.", w, f"How do you spell '{w}' backwards?", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 4:
        ws = rng.sample(WORDS, rng.randint(3, 6))
        question = f"Put these words in alphabetical order: {', '.join(ws)}."
        return "Sort the words alphabetically.", ", ".join(ws), question, ", ".join(sorted(ws)) + "."
    if kind == 5:
        n = rng.randint(0, 999)
        return "Write the number in words.", str(n), f"How do you write {n} in words?", f"{n} is {words(n)}."
    w = rng.choice(WORDS)
    c = rng.choice(sorted(set(w)))
    k = w.count(c)
    return (f"Count how many times the letter '{c}' appears.", w, f"How many times does '{c}' appear in '{w}'?",
            f"The letter '{c}' appears {k} time{'s' if k != 1 else ''} in '{w}'.")


def chat_record(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.3 else []
    turns = rng.choice([1, 1, 2, 3, 4])  # many single-turn, a good share multi-turn
    for t in range(turns):
        _, _, question, answer = task(rng)
        if t:
            question = rng.choice(["Next one: ", "Thanks. ", "And another: ", ""]) + question
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def alpaca_record(rng: random.Random) -> dict:
    instruction, inp, question, answer = task(rng)
    rec = {"instruction": instruction, "input": inp, "output": answer}
    if rng.random() < 0.25:  # some records carry the whole question and no input
        rec = {"instruction": question, "input": "", "output": answer}
    if rng.random() < 0.2:
        rec["system"] = rng.choice(SYSTEMS)
    return rec


def make_data(assets: Path) -> list[dict]:
    rng = random.Random(SEED)
    records = [chat_record(rng) for _ in range(N_CHAT)] + [alpaca_record(rng) for _ in range(N_ALPACA)]
    rng.shuffle(records)
    path = assets / "data" / "sft_sample.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return records


def corpus(records: list[dict]) -> list[str]:
    out = []
    for r in records:
        if "messages" in r:
            out += [m["content"] for m in r["messages"]]
        else:
            out += [r.get("system", ""), r["instruction"], r["input"], r["output"]]
    return [t for t in out if t]


def make_tokenizer(records: list[dict], assets: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(ROOT / "src"))
    from shardwise.data.template import DEFAULT_CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(records), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>",
                                   pad_token="<|pad|>", extra_special_tokens=SPECIAL[3:], model_max_length=4096)
    fast.chat_template = DEFAULT_CHAT_TEMPLATE
    out = assets / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        old.unlink()
    fast.save_pretrained(str(out))


def main() -> None:
    assets = Path(sys.argv[1]) if len(sys.argv) > 1 else ASSETS
    records = make_data(assets)
    make_tokenizer(records, assets)
    print(f"wrote {len(records)} records and a tokenizer (vocab <= {VOCAB}) under {assets}")


if __name__ == "__main__":
    main()
