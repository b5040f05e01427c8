"""`unbroken export --format hf`: tiny Llama and GPT-2 models, built here from configs (no
download), saved by unbroken, exported, and loaded back by transformers' own
from_pretrained with every weight equal; GPT-2's tied embedding stored once and tied
again on load; every safetensors file carries the metadata transformers 4.x requires."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

import unbroken
from unbroken.cli.main import main

transformers = pytest.importorskip("transformers")


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=128, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


class Holder(nn.Module):
    """A training wrapper (a LightningModule, say): its names start with ``model.``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def export(tmp_path, model, *args: str):
    torch.manual_seed(0)
    config = tmp_path / "config.json"
    model.config.to_json_file(config)
    ckpt = tmp_path / "ckpt"
    wrapped = Holder(model) if any(a.startswith("--strip-prefix") for a in args) else model
    unbroken.Checkpointer(ckpt).save(3, {"model": wrapped, "step": 3})
    out = tmp_path / "hf"
    argv = ["export", str(ckpt), str(out), "--format=hf", f"--config={config}", *args]
    assert main([*argv, "--max-shard-size=40KB", "-q"]) == 0
    return out, json.loads((out / "model.safetensors.index.json").read_text())


def check_files(out, index) -> None:
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n >= 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    total = 0
    for file in files:
        with safe_open(str(out / file), "pt") as f:
            assert f.metadata()["format"] == "pt"  # transformers 4.x refuses a file without it
            names = set(f.keys())
            assert names == {k for k, v in index["weight_map"].items() if v == file}
            total += sum(f.get_tensor(k).nbytes for k in names)
    assert index["metadata"]["total_size"] == total


def loads_equal(out, model):
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    expected, got = model.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    return loaded


@pytest.mark.timeout(60)
def test_gpt2_loads_with_its_tied_embedding_stored_once(tmp_path):
    model = gpt2()
    out, index = export(tmp_path, model)
    check_files(out, index)
    assert "transformer.wte.weight" in index["weight_map"]
    assert "lm_head.weight" not in index["weight_map"]  # one tensor in the model: once here
    loaded = loads_equal(out, model)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


@pytest.mark.timeout(60)
def test_llama_under_a_wrapper_loads_with_the_prefix_stripped(tmp_path):
    model = llama()
    out, index = export(tmp_path, model, "--strip-prefix=model.")
    check_files(out, index)
    # Untied: the output projection is its own tensor and is kept.
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= index["weight_map"].keys()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    loads_equal(out, model)


def test_single_file_export_carries_the_pt_format_metadata(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "model.safetensors"
    unbroken.Checkpointer(ckpt).save(1, {"model": nn.Linear(3, 2)})
    assert main(["export", str(ckpt), str(out), "-q"]) == 0
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"format": "pt", "unbroken_step": "1"}
        assert set(f.keys()) == {"weight", "bias"}


def test_stripping_a_prefix_that_makes_two_names_equal_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    state = {"model": nn.Linear(2, 2), "ema": nn.Linear(2, 2)}
    unbroken.Checkpointer(ckpt).save(1, state)
    argv = ["export", str(ckpt), str(tmp_path / "o"), "--format=hf", "--only=model"]
    assert main([*argv, "--only=ema", "--strip-prefix=model/", "--strip-prefix=ema/"]) == 2
    assert "would both be exported as 'weight'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_tie_whose_bytes_differ_is_kept_and_an_unknown_architecture_drops_nothing(tmp_path):
    model = gpt2()  # trained untied: the config still says tied, the bytes say otherwise
    model.lm_head.weight = nn.Parameter(model.transformer.wte.weight.detach() + 1)
    out, index = export(tmp_path, model)
    assert {"lm_head.weight", "transformer.wte.weight"} <= index["weight_map"].keys()
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "no-such-model"}))
    argv = ["export", str(tmp_path / "ckpt"), str(out), "--format=hf", f"--config={config}"]
    assert main([*argv, "--force", "-q"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(index["weight_map"]) == len(model.state_dict())
