"""A local bf16 safetensors checkpoint read into each rank's part (shardwise.train.model.weights) on 2
gloo ranks: every engine ends with exactly the checkpoint's weights, and its forward gives the
logits (within 1e-5) and the loss `from_pretrained` in fp32 gives (ZeRO-3's own linear differs in
the last digits: 1e-5 relative)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from conftest import run_once  # noqa: E402
from sharded_load_worker import fixed_batch  # noqa: E402

ITEMS = ["ddp", "zero2", "zero3", "fsdp", "ddp:lora", "zero3:lora", "fsdp:lora"]
BIN_ITEMS = ["ddp", "zero3", "fsdp:lora"]  # a .bin checkpoint: rank 0 reads, broadcasts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("bf16-ckpt")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")  # 4 shards + index
    assert len(list(path.glob("model-*.safetensors"))) > 1
    return path


@pytest.fixture(scope="module")
def bin_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The same weights as PyTorch pickles (`pytorch_model.bin`, as older checkpoints ship)."""
    import shutil

    from safetensors.torch import load_file

    path = tmp_path_factory.mktemp("bin-ckpt")
    shutil.copy(checkpoint / "config.json", path / "config.json")
    state = {}
    for f in sorted(checkpoint.glob("model-*.safetensors")):
        state.update(load_file(f))
    torch.save(state, path / "pytorch_model.bin")
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint, bin_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded-load")
    items = [f"{checkpoint}:{i}" for i in ITEMS] + [f"{bin_checkpoint}:{i}:bin" for i in BIN_ITEMS]
    return run_once(out, HERE / "sharded_load_worker.py", [(items, 2, 400)])


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import AutoModelForCausalLM

    from shardwise.train.engines.base import token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    batch = fixed_batch(128)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        loss = token_loss_sum(logits, batch["labels"]).double().item()
    return loss, model.state_dict(), logits


def _name(item: str) -> str:
    strategy, *flags = item.split(":")
    return f"{strategy}{'-lora' if 'lora' in flags else ''}{'-bin' if 'bin' in flags else ''}-w2.pt"


@pytest.mark.parametrize("item", ITEMS + [f"{i}:bin" for i in BIN_ITEMS])
def test_weights_and_loss_equal_from_pretrained(loaded, reference, item):
    ref_loss, ref_state, ref_logits = reference
    got = torch.load(loaded / _name(item), weights_only=True)
    assert (got["logits"] - ref_logits).abs().max().item() <= 1e-5
    base = {k.replace(".base_layer", ""): v for k, v in got["weights"].items() if "lora_" not in k}
    assert base.keys() == ref_state.keys()
    for k, v in base.items():
        assert torch.equal(v.float(), ref_state[k]), k  # bf16 values read into fp32: exact
    tol = 1e-5 * abs(ref_loss) if item.startswith("zero3") else 1e-9 * abs(ref_loss)
    assert abs(got["loss_sum"] - ref_loss) <= tol, (got["loss_sum"], ref_loss)


def test_adapters_equal_on_every_engine(loaded):
    """The adapters come from the run's seed, not from how the base was built."""
    runs = [torch.load(loaded / _name(i), weights_only=True)["weights"]
            for i in ITEMS + [f"{i}:bin" for i in BIN_ITEMS] if "lora" in i]
    adapters = [{k: v for k, v in w.items() if "lora_" in k} for w in runs]
    assert adapters[0] and all(a.keys() == adapters[0].keys() for a in adapters)
    for a in adapters[1:]:
        for k, v in a.items():
            assert torch.equal(v, adapters[0][k]), k
    assert any(bool(v.abs().sum() > 0) for k, v in adapters[0].items() if "lora_A" in k)  # initialised, not empty
    assert all(bool((v == 0).all()) for k, v in adapters[0].items() if "lora_B" in k)


def test_key_mapping():
    from shardwise.train.model.weights_read import checkpoint_key

    assert checkpoint_key("model.layers.0.self_attn.q_proj.base_layer.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert checkpoint_key("model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert checkpoint_key("lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert checkpoint_key("lm_head.original_module.weight") == "lm_head.weight"


def test_checkpoint_missing_tensor_is_refused(checkpoint, tmp_path):
    """A checkpoint whose tensors do not match its config fails naming the tensor, before any
    weights are read."""
    import shutil

    from safetensors.torch import load_file, save_file

    from shardwise.errors import ShardwiseError
    from shardwise.train.model.weights import meta_model
    from shardwise.train.model.weights_read import load_safetensors

    bad = tmp_path / "bad"
    shutil.copytree(checkpoint, bad)
    for f in bad.glob("model-*.safetensors"):
        t = load_file(f)
        if "model.norm.weight" in t:
            del t["model.norm.weight"]
            save_file(t, f, metadata={"format": "pt"})
    from types import SimpleNamespace

    run = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(path=str(bad), trust_remote_code=False)))
    model = meta_model(run, "eager")
    model.to_empty(device="cpu")
    with pytest.raises(ShardwiseError, match=r"1 tensor\(s\) missing \(e.g. \['model.norm.weight'\]\)"):
        load_safetensors(model, bad)


def test_a_tied_lm_head_is_the_embedding_it_was_saved_as(tmp_path):
    """A checkpoint with tied embeddings (Qwen2.5, Llama-3.2) holds the embedding only: lm_head
    must be that tensor on the meta build (which FSDP2 shards) and after `materialize` allocates
    it (DDP, ZeRO-0/1/2), not a tensor of its own left unfilled (zeros or heap garbage)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.config.schema import TrainConfig
    from shardwise.run import run_spec
    from shardwise.train.model.build import build_model
    from shardwise.train.model.weights import materialize

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    embedding = load_file(str(tmp_path / "model.safetensors"))["model.embed_tokens.weight"]
    for precision in ("bf16-mixed", "bf16-pure"):
        run = run_spec(TrainConfig.model_validate({
            "model": {"name": None, "path": str(tmp_path)}, "strategy": {"name": "ddp"}, "precision": precision,
            "data": {"kind": "synthetic"}, "run": {"device": "cpu", "nproc": 1}}), 1, "cpu", environ={})
        model = build_model(run, deferred=True)
        assert model.lm_head.weight is model.get_input_embeddings().weight and model.lm_head.weight.is_meta
        materialize(model, torch.device("cpu"))
        assert model.lm_head.weight is model.get_input_embeddings().weight
        assert torch.equal(model.lm_head.weight, embedding.to(model.lm_head.weight.dtype)), precision
