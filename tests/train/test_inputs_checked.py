"""Inputs checked before ranks start (issue "Runs that survive", items 6 and 7).

6. The data is parsed, validated, templated and tokenised once, by preflight, into a cache
   that every rank and every resume loads (same rows, same order, same packing as building
   it in place); the model directory's own tokenizer is the default and a tokenizer that does
   not fit the embedding is refused; `plan --emit` writes placeholders that `train` refuses.
7. Inputs that used to crash or hang are one ShardwiseError naming file/line/field, and the
   CLI exits 2 without a traceback: non-UTF-8 YAML, alias bombs, CUDA on a CPU host, a world
   size < 1, an unusable --emit target, a record nested 100k levels deep.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from shardwise.config.load import load_config
from shardwise.config.schema import TrainConfig
from shardwise.errors import ShardwiseError
from shardwise.train.preflight import check_device, check_launch, preflight

RECORD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."}]}


def chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
                         {"role": "assistant", "content": f"{i} + {i} = {2 * i}." + " More words." * (i % 7)}]}  # fmt: skip


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sft_config(tmp_path: Path, **over) -> TrainConfig:
    """A tiny-llama SFT run on 60 chat records, outputs (and the data cache) under tmp_path."""
    data = write_jsonl(tmp_path / "train.jsonl", [chat(i) for i in range(60)])
    raw = {"model": {"name": "tiny-llama"}, "precision": "fp32",
           "data": {"sft": {"train_files": [str(data)], "max_length": 64}},
           "run": {"micro_batch": 2, "grad_accum": 2, "device": "cpu", "steps": 3},
           "checkpointing": {"output_dir": str(tmp_path / "out")}}  # fmt: skip
    for key, value in over.items():
        section, field = key.split("__")
        raw.setdefault(section, {})[field] = value
    return TrainConfig.model_validate(raw)


def cli(args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    """`shardwise train ...` as a user runs it (the trainer's module entry point)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "shardwise.train.cli", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env=env)  # fmt: skip


def assert_user_error(r, *fragments: str) -> None:
    """Exit code 2 (ExitCode.USER_ERROR), every fragment in the message, no traceback. `r` is a
    subprocess result or a typer CliRunner result."""
    err = getattr(r, "stderr", None) or r.output
    code = r.returncode if isinstance(r, subprocess.CompletedProcess) else r.exit_code
    assert code == 2, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    exc = getattr(r, "exception", None)  # CliRunner: an uncaught exception would be kept here
    assert exc is None or isinstance(exc, SystemExit), repr(exc)
    for f in fragments:
        assert f in err, f"{f!r} not in: {err[-2000:]}"


def cache_dirs(cfg: TrainConfig) -> list[Path]:
    root = Path(cfg.checkpointing.output_dir) / ".shardwise" / "data-cache"
    return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


# ------------------------------------------------------------------ 6. data tokenised once


def first_steps(run, world: int, steps: int = 3) -> list[list[list[dict]]]:
    """The trainer's batches (per rank, per step, per micro-batch) for `run`."""
    from shardwise.train.data import build_source
    from shardwise.train.engines.base import DistEnv

    out = []
    for rank in range(world):
        source = build_source(run, DistEnv(rank=rank, world_size=world), vocab_size=2048)
        out.append([next(source) for _ in range(steps)])
    return out


def test_preflight_tokenises_once_and_ranks_get_identical_batches_from_the_cache(tmp_path, monkeypatch):
    """Preflight writes the cache; build_sft loads it (memory-mapped, without tokenising: the
    encoder is disabled) and the trainer sees the same rows, order and packing as without it."""
    import torch

    from shardwise.data import build_dataset, load_dataset, load_tokenizer
    from shardwise.data.tokenize import Encoder
    from shardwise.run import run_spec
    from shardwise.train.sft_data import data_config

    cfg = sft_config(tmp_path)
    without = first_steps(run_spec(cfg, 2, "cpu"), world=2)  # no preflight yet: built in memory
    assert cache_dirs(cfg) == []
    run, _ = preflight(cfg, world_size=2, device="cpu")
    (cache,) = cache_dirs(cfg)
    assert sorted(f.name for f in cache.iterdir()) == ["lengths.npy", "meta.json", "offsets.npy", "row_docs.npy",
                                                       "row_offsets.npy", "target.npy", "tokens.npy"]  # no pickle

    def no_tokenising(*a, **k):
        raise AssertionError("a rank tokenised although the cache was there")

    monkeypatch.setattr(Encoder, "encode", no_tokenising)
    loaded = load_dataset(cache)
    assert isinstance(loaded.tokens, np.memmap)  # ranks of a node share the pages
    with_cache = first_steps(run, world=2)
    for rank_a, rank_b in zip(without, with_cache, strict=True):
        for step_a, step_b in zip(rank_a, rank_b, strict=True):
            for mb_a, mb_b in zip(step_a, step_b, strict=True):
                assert mb_a.keys() == mb_b.keys()
                for k in mb_a:  # tensors, and the ints of a padding-free batch (max_length_q/k)
                    same = torch.equal(mb_a[k], mb_b[k]) if isinstance(mb_a[k], torch.Tensor) else mb_a[k] == mb_b[k]
                    assert same, k
    monkeypatch.undo()

    built = build_dataset(data_config(cfg), load_tokenizer())
    assert loaded.rows == built.rows and loaded.where == built.where and len(loaded) == len(built) > 1
    for i in range(len(built)):
        a, b = built[i], loaded[i]
        assert np.array_equal(a["input_ids"], b["input_ids"]) and np.array_equal(a["labels"], b["labels"])
        assert a["seq_lens"] == b["seq_lens"]
    assert loaded.stats.summary() == built.stats.summary()
    assert loaded.stats.encode.lengths == built.stats.encode.lengths

    # a resume (a new preflight on the same config) finds it: nothing is tokenised again
    monkeypatch.setattr(Encoder, "encode", no_tokenising)
    preflight(cfg, world_size=2, device="cpu")
    assert cache_dirs(cfg) == [cache]


def test_cache_key_follows_data_files_config_and_tokenizer(tmp_path):
    from shardwise.data import default_tokenizer_path
    from shardwise.data.cache import cache_key
    from shardwise.train.sft_data import data_config

    cfg = sft_config(tmp_path)
    dc, tok = data_config(cfg), default_tokenizer_path()
    key = cache_key(dc, tok)
    assert cache_key(dc, tok) == key  # deterministic
    assert cache_key(dc.model_copy(update={"seed": 7}), tok) == key  # seed: the sampler's, not the data's
    assert cache_key(dc.model_copy(update={"max_length": 128}), tok) != key
    assert cache_key(dc.model_copy(update={"seed": 7, "validation_fraction": 0.1}), tok) != cache_key(
        dc.model_copy(update={"validation_fraction": 0.1}), tok)  # fmt: skip
    other = tmp_path / "tok"
    shutil.copytree(tok, other)
    assert cache_key(dc, other) == key  # contents, not where they are
    (other / "chat_template.jinja").write_text((other / "chat_template.jinja").read_text() + "\n")
    assert cache_key(dc, other) != key
    data = Path(dc.train_files[0])
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cache_key(dc, tok) != key


def test_ranks_racing_for_the_cache_build_it_once(tmp_path):
    """Three processes (torchrun ranks each run preflight) ask at once: one tokenises, the
    others wait on the lock and load the same directory."""
    from shardwise.train.sft_data import data_config

    cfg = sft_config(tmp_path)
    dc = data_config(cfg)
    (tmp_path / "dc.json").write_text(dc.model_dump_json())
    log = tmp_path / "builds.log"
    script = textwrap.dedent(f"""
        import sys
        from shardwise.config.data import DataConfig
        from shardwise.data import default_tokenizer_path, load_tokenizer
        from shardwise.data import cache
        build = cache.build_dataset
        def counted(*a, **k):
            with open({str(log)!r}, "a") as f:
                f.write("build\\n")
            return build(*a, **k)
        cache.build_dataset = counted
        dc = DataConfig.model_validate_json(open({str(tmp_path / "dc.json")!r}).read())
        tok_dir = default_tokenizer_path()
        print(cache.ensure_cache(dc, load_tokenizer(tok_dir), tok_dir, {str(tmp_path / "cache")!r}))
    """)  # fmt: skip
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1
    assert log.read_text().splitlines() == ["build"]


def test_a_killed_builder_leaves_nothing_that_loads(tmp_path):
    """A cache directory appears only whole (renamed from a temp dir); leftovers of a builder
    that died, and a directory under the key that does not load, are replaced by a new build."""
    from shardwise.data import default_tokenizer_path, ensure_cache, load_dataset, load_tokenizer
    from shardwise.data.cache import cache_key
    from shardwise.train.sft_data import data_config

    dc, tok_dir = data_config(sft_config(tmp_path)), default_tokenizer_path()
    root = tmp_path / "cache"
    key = cache_key(dc, tok_dir)
    (root / f"{key}.tmp-dead").mkdir(parents=True)
    (root / f"{key}.tmp-dead" / "tokens.npy").write_bytes(b"half")
    (root / key).mkdir()  # a directory with the key's name but no meta.json
    path = ensure_cache(dc, load_tokenizer(tok_dir), tok_dir, root)
    assert path == root / key and len(load_dataset(path)) > 0
    assert not list(root.glob(f"{key}.tmp-*"))
    with pytest.raises(ShardwiseError, match=r"data cache .*cannot be read.*delete the directory"):
        (path / "meta.json").write_text("{")
        load_dataset(path)


def test_unusable_output_dir_for_the_cache_names_the_field(tmp_path):
    cfg = sft_config(tmp_path)
    Path(cfg.checkpointing.output_dir).write_text("a file, not a directory")
    # the output dir is checked before the cache is built in it
    with pytest.raises(ShardwiseError, match=r"checkpointing\.output_dir: .* is a file, not a directory"):
        preflight(cfg, world_size=1, device="cpu")


def test_data_error_at_preflight_names_file_and_line_and_leaves_no_cache(tmp_path):
    cfg = sft_config(tmp_path)
    bad = write_jsonl(tmp_path / "bad.jsonl", [RECORD, {"messages": [{"role": "user", "content": "no reply"}]}])
    cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={
        "sft": cfg.data.sft.model_copy(update={"train_files": [str(bad)]})})})  # fmt: skip
    with pytest.raises(ShardwiseError, match=r"bad\.jsonl:2: field 'messages': no target tokens"):
        preflight(cfg, world_size=1, device="cpu")
    assert cache_dirs(cfg) == []


# ------------------------------------------------------------------ 6. tokenizer and model


@pytest.fixture
def model_dir(tmp_path):
    """A local HF model directory (config.json of tiny-llama; random_init, so no weights)."""
    from shardwise.catalog import get_model

    def make(vocab_size: int = 2048, tokenizer: bool = True, name: str = "model") -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(get_model("tiny-llama").to_hf_dict() | {"vocab_size": vocab_size}))
        if tokenizer:
            from shardwise.data import default_tokenizer_path

            for f in default_tokenizer_path().iterdir():
                shutil.copy2(f, d / f.name)
        return d

    return make


def with_model(cfg: TrainConfig, path: Path, tokenizer: str | None = None) -> TrainConfig:
    model = cfg.model.model_copy(update={"path": str(path), "random_init": True})
    return cfg.model_copy(update={"model": model, "data": cfg.data.model_copy(update={"tokenizer": tokenizer})})


def test_model_directory_tokenizer_is_the_default(tmp_path, model_dir):
    from shardwise.train.sft_data import resolved_tokenizer_path

    d = model_dir()
    cfg = with_model(sft_config(tmp_path), d)
    assert resolved_tokenizer_path(cfg) == str(d)
    preflight(cfg, world_size=1, device="cpu")
    # a catalog model (random init) keeps the bundled tokenizer
    from shardwise.data import default_tokenizer_path

    assert resolved_tokenizer_path(sft_config(tmp_path)) == str(default_tokenizer_path())


def test_model_directory_without_tokenizer_is_refused(tmp_path, model_dir):
    cfg = with_model(sft_config(tmp_path), model_dir(tokenizer=False))
    with pytest.raises(ShardwiseError, match=r"model\.path .* has no tokenizer files .*set data\.tokenizer"):
        preflight(cfg, world_size=1, device="cpu")
    assert cache_dirs(cfg) == []  # refused before anything was tokenised
    other = model_dir(name="tok")  # an explicit data.tokenizer is used instead
    preflight(with_model(cfg, Path(cfg.model.path), tokenizer=str(other)), world_size=1, device="cpu")


def test_tokenizer_larger_than_the_embedding_is_refused_with_both_numbers(tmp_path, model_dir):
    from shardwise.data import load_tokenizer

    tok = load_tokenizer()
    n = len(tok)  # the bundled tokenizer's ids
    cfg = with_model(sft_config(tmp_path), model_dir(vocab_size=n - 100))
    with pytest.raises(ShardwiseError, match=rf"has {n} tokens .*vocab_size {n - 100}"):
        preflight(cfg, world_size=1, device="cpu")
    assert cache_dirs(cfg) == []
    # added tokens count: n + 1 ids do not fit an embedding of exactly n rows (n alone does)
    preflight(with_model(cfg, model_dir(vocab_size=n, name="exact")), world_size=1, device="cpu")
    tok.add_tokens(["<|tool|>"])
    tok.save_pretrained(tmp_path / "tok-added")
    cfg = with_model(cfg, model_dir(vocab_size=n, name="m2"), tokenizer=str(tmp_path / "tok-added"))
    with pytest.raises(ShardwiseError, match=rf"has {n + 1} tokens .*added tokens included.*vocab_size {n}"):
        preflight(cfg, world_size=1, device="cpu")


def test_emitted_config_is_refused_until_its_placeholders_are_filled(tmp_path):
    """`plan --emit` then `train` on the emitted file unchanged: exit 2 naming both fields."""
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    out = tmp_path / "emit"
    r = CliRunner().invoke(app, ["plan", "-m", "tiny-llama", "--gpus", "1", "--emit", str(out),
                                 "--emit-strategy", "ddp"])  # fmt: skip
    assert r.exit_code == 0, r.output
    text = (out / "shardwise.yaml").read_text()
    assert "# REQUIRED" in text and "<FILL IN" in text
    r = cli([str(out / "shardwise.yaml")])
    assert_user_error(r, "shardwise.yaml:", "'model.path'", "'data.sft.train_files'", "--set model.path=")
    # filled in (here: the catalog architecture, random weights, on a data file): accepted
    cfg = load_config(out / "shardwise.yaml", ["model.path=", f"data.sft.train_files=[{tmp_path / 'train.jsonl'}]"])
    assert (cfg.model.name, cfg.model.path, cfg.data.sft.train_files) == (
        "tiny-llama", None, [str(tmp_path / "train.jsonl")])


# ------------------------------------------------------------------ 7. YAML that crashed or hung

BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)  # 9 lines, 9^9 = 387 million strings once expanded


def test_non_utf8_config_is_one_error_with_line(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_bytes("name: demo\nrun:\n  steps: 3 # café\n".encode("latin-1"))
    with pytest.raises(ShardwiseError, match=r"cfg\.yaml:3: not UTF-8 text \(byte 0xe9 .*expected .*UTF-8"):
        load_config(p)
    assert_user_error(cli([str(p)]), "cfg.yaml:3: not UTF-8")


def test_alias_bomb_is_refused_fast(tmp_path):
    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB)
    t0 = time.perf_counter()
    with pytest.raises(ShardwiseError, match=r"bomb\.yaml:\d+: the YAML values expand to more than 100,000"):
        load_config(p)
    assert time.perf_counter() - t0 < 2.0
    assert_user_error(cli([str(p)], timeout=60), "bomb.yaml:", "alias")


def test_cyclic_alias_and_bomb_in_an_override_are_refused(tmp_path):
    p = tmp_path / "cycle.yaml"
    p.write_text("name: x\nrun: &r\n  steps: [*r]\n")
    with pytest.raises(ShardwiseError, match=r"cycle\.yaml:\d+: a YAML alias refers to the node that contains it"):
        load_config(p)
    ok = tmp_path / "ok.yaml"
    ok.write_text("name: x\n")
    flow = "[" + ", ".join(f"&{c} [{', '.join([f'*{q}'] * 9)}]" for q, c in zip("abcdefgh", "bcdefghi",
                                                                                 strict=True)) + "]"  # fmt: skip
    t0 = time.perf_counter()
    with pytest.raises(ShardwiseError, match=r"^--set 'name=.*expand to more than"):  # by the file's own reader
        load_config(ok, ["name=" + "[&a [1,1,1,1,1,1,1,1,1], " + flow[1:]])
    assert time.perf_counter() - t0 < 2.0


def test_modest_aliases_and_merge_keys_still_load(tmp_path):
    p = tmp_path / "anchors.yaml"
    p.write_text("optimizer: &opt\n  lr: 3.0e-4\n  weight_decay: 0.1\nschedule:\n  kind: cosine\n"
                 "data:\n  kind: synthetic\n  synthetic: {samples: 8, seq_len: 16}\n"
                 "strategy:\n  name: fsdp\n  fsdp: &knobs {}\n  ddp: *knobs\n")  # fmt: skip
    cfg = load_config(p)
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay, cfg.data.synthetic.samples) == (3e-4, 0.1, 8)


def test_deeply_nested_yaml_is_one_error(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("name: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ShardwiseError, match=r"deep\.yaml:1: YAML nested too deeply"):
        load_config(p)
    p.write_text("name: x\n")
    with pytest.raises(ShardwiseError, match=r"--set 'name=\[\[\[.*nested too deeply"):
        load_config(p, ["name=" + "[" * 100_000 + "]" * 100_000])


# ------------------------------------------------------------------ 7. launch: device, world size


def synthetic_yaml(tmp_path: Path, **run) -> Path:
    p = tmp_path / "synthetic.yaml"
    raw = {"model": {"name": "tiny-llama"}, "precision": "fp32",
           "data": {"kind": "synthetic", "synthetic": {"samples": 16, "seq_len": 16}},
           "run": {"steps": 1, "micro_batch": 1, "grad_accum": 1, "nproc": 1, "device": "cpu"} | run,
           "checkpointing": {"output_dir": str(tmp_path / "out")},
           "logging": {"tensorboard": False, "progress": False}}  # fmt: skip
    p.write_text(yaml.safe_dump(raw))
    return p


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a host without CUDA")
def test_cuda_on_a_host_without_cuda_is_one_error(tmp_path):
    r = cli([str(synthetic_yaml(tmp_path, nproc=2)), "--set", "run.device=cuda"])
    assert_user_error(r, "run.device is 'cuda'", "no usable CUDA device", "--set run.device=cpu")
    assert r.stderr.count("error:") == 1  # once, from preflight, not once per rank


def test_more_local_ranks_than_gpus_is_refused(tmp_path, monkeypatch):
    import shardwise.train.preflight as pf

    monkeypatch.setattr(pf, "cuda_device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    cfg = TrainConfig.model_validate({"run": {"device": "cuda"}, "data": {"kind": "synthetic"}})
    with pytest.raises(ShardwiseError, match=r"4 ranks on this node need 4 CUDA devices, 2 visible.*--nproc 2"):
        check_device(cfg, "cuda", world_size=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 ranks on each of 2 nodes
    check_device(cfg, "cuda", world_size=4)


@pytest.mark.parametrize("world", [0, -1])
def test_world_size_below_one_is_refused_by_preflight(world):
    cfg = TrainConfig.model_validate({"data": {"kind": "synthetic"}})
    with pytest.raises(ShardwiseError, match=rf"world size {world}: expected at least 1 rank"):
        preflight(cfg, world_size=world, device="cpu")
    with pytest.raises(ShardwiseError, match=r"run.device resolved to 'tpu'"):
        check_launch(1, "tpu")


def test_negative_nproc_on_the_command_line_is_one_error(tmp_path):
    assert_user_error(cli([str(synthetic_yaml(tmp_path)), "--nproc", "-1"]), "world size -1", "--nproc")


def test_nproc_zero_on_the_command_line_is_one_error(tmp_path):
    assert_user_error(cli([str(synthetic_yaml(tmp_path)), "--nproc", "0"]), "world size 0")


# ------------------------------------------------------------------ 7. plan --emit targets


def emit(target: Path):
    from typer.testing import CliRunner

    from shardwise.cli.app import app

    return CliRunner().invoke(app, ["plan", "-m", "tiny-llama", "--gpus", "1", "--emit", str(target),
                                    "--emit-strategy", "ddp"])  # fmt: skip


def test_emit_into_an_existing_file_is_one_error(tmp_path):
    target = tmp_path / "taken"
    target.write_text("mine")
    r = emit(target)
    assert_user_error(r, "--emit", "is an existing file; expected a directory")
    assert target.read_text() == "mine"


def test_emit_into_a_read_only_directory_is_one_error(tmp_path, monkeypatch):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o555)
    try:
        if os.geteuid() == 0:  # root writes anyway: give the check the answer a user would get
            import shardwise.emit.safe_write as emit_mod

            real = os.access
            monkeypatch.setattr(emit_mod.os, "access",
                                lambda p, m, **k: False if Path(p) == target and m & os.W_OK else real(p, m, **k))
        else:  # a new directory under a read-only one cannot be created
            assert_user_error(emit(target / "sub"), "--emit", "cannot create the directory")
        assert_user_error(emit(target), "--emit", "the directory is not writable")
        assert list(target.iterdir()) == []
    finally:
        target.chmod(0o755)


def test_emit_write_failure_midway_is_one_error(tmp_path, monkeypatch):
    """A disk that fills up (or a read-only mount root cannot write either): the file named."""
    real = Path.write_text

    def full(self, *a, **k):
        if self.name == "accelerate.yaml":
            raise OSError(28, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    assert_user_error(emit(tmp_path / "out"), "cannot write accelerate.yaml (No space left on device)")


# ------------------------------------------------------------------ 7. data nested 100k levels deep

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.fixture(scope="module")
def tok():
    from shardwise.data import load_tokenizer

    return load_tokenizer()


def test_jsonl_line_nested_100k_levels_is_an_error_with_line(tmp_path, tok):
    from shardwise.config.data import DataConfig
    from shardwise.data import build_dataset

    path = write_jsonl(tmp_path / "deep.jsonl", [RECORD, '{"messages": ' + DEEP + "}", RECORD])
    with pytest.raises(ShardwiseError, match=r"deep\.jsonl:2: JSON nested too deeply"):
        build_dataset(DataConfig(train_files=[str(path)]), tok)
    ds = build_dataset(DataConfig(train_files=[str(path)], on_error="skip"), tok)
    assert ds.num_documents == 2 and ds.stats.skipped_invalid == 1


def test_json_array_element_nested_100k_levels_names_its_line(tmp_path, tok):
    from shardwise.config.data import DataConfig
    from shardwise.data import build_dataset

    path = tmp_path / "deep.json"
    path.write_text("[\n" + json.dumps(RECORD) + ",\n" + json.dumps(RECORD) + ",\n" + DEEP + "\n]\n")
    with pytest.raises(ShardwiseError, match=r"deep\.json:4: JSON nested too deeply"):
        build_dataset(DataConfig(train_files=[str(path)]), tok)


def test_parseable_but_deep_record_is_refused_before_later_stages(tmp_path, tok):
    """Nesting under Python's recursion limit parses; it is refused at validation, naming the
    field, so no later stage ever walks it."""
    from shardwise.config.data import DataConfig
    from shardwise.data import build_dataset

    deep = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "meta": json.loads("[" * 200 + "]" * 200)}  # fmt: skip
    path = write_jsonl(tmp_path / "meta.jsonl", [RECORD, deep])
    with pytest.raises(ShardwiseError, match=r"meta\.jsonl:2: field 'meta': nested more than 32 levels"):
        build_dataset(DataConfig(train_files=[str(path)]), tok)


def test_deep_record_through_the_cli_is_one_error_before_any_rank(tmp_path):
    data = write_jsonl(tmp_path / "deep.jsonl", [RECORD, '{"messages": ' + DEEP + "}"])
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({
        "model": {"name": "tiny-llama"}, "precision": "fp32", "run": {"nproc": 2, "device": "cpu"},
        "data": {"sft": {"train_files": [str(data)], "max_length": 64}},
        "checkpointing": {"output_dir": str(tmp_path / "out")}}))  # fmt: skip
    assert_user_error(cli([str(cfg)]), "deep.jsonl:2: JSON nested too deeply")


# ------------------------------------------------------------------ attention kernels transformers lacks


def _arch_dir(tmp_path: Path, name: str, cfg: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=128, vocab_size=512, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
            bos_token_id=2)
# gemma2 keeps its logit softcappings (transformers' defaults: attention 50, final 30)
GEMMA2 = dict(model_type="gemma2", **TINY)
# MPT: analytic family, planned with a fused (llm-foundry) attention core under sdpa
MPT = dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256, vocab_size=512)
# VaultGemma: no analytic family (read on the meta device), `_supports_sdpa = False`
VAULTGEMMA = dict(model_type="vaultgemma", **TINY)


def arch_config(tmp_path: Path, path: Path, **over) -> TrainConfig:
    raw = {"model": {"path": str(path), "random_init": True, "name": None}, "precision": "fp32",
           "data": {"kind": "synthetic", "synthetic": {"samples": 8, "seq_len": 16}},
           "run": {"steps": 1, "micro_batch": 1, "device": "cpu"},
           "checkpointing": {"output_dir": str(tmp_path / "out")},
           "logging": {"tensorboard": False, "progress": False}}  # fmt: skip
    for key, value in over.items():
        section, field = key.split("__")
        raw.setdefault(section, {})[field] = value
    return TrainConfig.model_validate(raw)


def _forward_backward(model, vocab: int) -> None:
    import torch

    ids = torch.randint(0, vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_gemma2_under_sdpa_is_built_eager_as_planned_with_a_note(tmp_path, capsys):
    """transformers refuses attn_implementation="sdpa" for Gemma2 (no SDPA path for its
    softcapping); the planner already plans eager for it, so the trainer builds eager and says so."""
    from shardwise.plan.activations import attention_kind
    from shardwise.train.model.build import build_model

    cfg = arch_config(tmp_path, _arch_dir(tmp_path, "gemma2", GEMMA2))
    assert cfg.model.attention == "sdpa"  # the default
    run, _ = preflight(cfg, world_size=1, device="cpu")
    note = capsys.readouterr().out
    assert "model.attention is 'sdpa'" in note and "'eager'" in note and "model.attention: eager" in note
    assert attention_kind(run.model, run.train) == "eager"  # what the memory check planned
    model = build_model(run)
    assert model.config._attn_implementation == "eager"
    _forward_backward(model, GEMMA2["vocab_size"])
    # asked for eager: built eager, nothing to say
    run, _ = preflight(arch_config(tmp_path, Path(cfg.model.path), model__attention="eager"), 1, "cpu")
    assert "model.attention" not in capsys.readouterr().out
    assert build_model(run).config._attn_implementation == "eager"


@pytest.mark.parametrize(("name", "arch"), [("mpt", MPT), ("vaultgemma", VAULTGEMMA)])
def test_sdpa_the_architecture_lacks_is_refused_naming_the_field(tmp_path, name, arch):
    """Where the plan assumed SDPA but transformers has none (MPT's plan is llm-foundry's fused
    kernel; a meta-path architecture without `_supports_sdpa`), running eager would break the
    memory check: refused before any rank starts, naming model.attention; eager then builds."""
    from shardwise.train.model.build import build_model

    path = _arch_dir(tmp_path, name, arch)
    with pytest.raises(ShardwiseError, match=r"model\.attention is 'sdpa'.*no SDPA path.*set model\.attention: eager"):
        preflight(arch_config(tmp_path, path), world_size=1, device="cpu")
    run, _ = preflight(arch_config(tmp_path, path, model__attention="eager"), world_size=1, device="cpu")
    model = build_model(run)
    assert model.config._attn_implementation == "eager"
    _forward_backward(model, arch["vocab_size"])


def test_no_sdpa_table_matches_transformers():
    """run.resolve.NO_SDPA (the analytic families preflight refuses or maps under sdpa) is what
    the installed transformers' causal-LM classes say."""
    from shardwise.run.resolve import NO_SDPA
    from shardwise.specs.families import ANALYTIC_FAMILIES
    from shardwise.train.model.hf import causal_lm_class

    lacking = {f for f in ANALYTIC_FAMILIES if not causal_lm_class(f)._supports_sdpa}
    assert lacking == set(NO_SDPA)


def test_gemma2_trains_through_the_cli(tmp_path):
    path = _arch_dir(tmp_path, "gemma2", GEMMA2)
    p = tmp_path / "gemma2.yaml"
    p.write_text(yaml.safe_dump(arch_config(tmp_path, path).model_dump(mode="json", exclude={"source"})))
    r = cli([str(p)])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "model.attention is 'sdpa'" in r.stdout
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "completed", summary
