"""Language models planned from their config: the models transformers and peft build, the
4-bit and 8-bit storage bitsandbytes keeps, CPU peaks predicted and measured, plans for 7-8B
configs on 16 and 24 GB cards, and the refusals."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import warnings
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
from bigbatch.cli.main import main  # noqa: E402
from bigbatch.memory.bnb import QuantizedLinear, quantized_bytes  # noqa: E402
from bigbatch.memory.evaluate import predict_evaluation_peak  # noqa: E402
from bigbatch.memory.fsdp import fake_ranks  # noqa: E402
from bigbatch.memory.lm import (  # noqa: E402
    LMPlan,
    LMSetup,
    lm_spec_at,
    load_lm_config,
    model_sizes,
    per_rank_bytes,
    plan_lm,
)
from bigbatch.memory.measure import measure_peak, measure_step_peak  # noqa: E402
from bigbatch.memory.meta import build_on_meta  # noqa: E402
from bigbatch.memory.plan import DoesNotFitError  # noqa: E402
from bigbatch.memory.predict import live_peak, predict_peak  # noqa: E402
from bigbatch.memory.step import make_inputs, run_step_loss  # noqa: E402

# The shapes of the public configs (written in the repository: no download).
sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from gpu_matrix import HF_CONFIGS  # noqa: E402

LLAMA3_8B, QWEN25_7B = HF_CONFIGS["llama3-8b"], HF_CONFIGS["qwen2.5-7b"]


def write_config(folder: Path, values: dict) -> Path:  # type: ignore[type-arg]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def tiny(**extra) -> object:  # type: ignore[no-untyped-def]
    return transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **extra,
    )  # fmt: skip


def test_config_from_a_file_a_folder_and_the_hub_cache(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    folder = write_config(tmp_path / "qwen", QWEN25_7B)
    assert load_lm_config(folder).model_type == "qwen2"
    assert load_lm_config(folder / "config.json").hidden_size == 3584
    # A hub name, from a Hugging Face cache laid out as the hub client writes it, offline.
    snapshot = tmp_path / "hub" / "models--org--llama3" / "snapshots" / "0123abc"
    write_config(snapshot, LLAMA3_8B)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abc")
    import huggingface_hub.constants as hub
    import transformers.utils.hub as tf_hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(tf_hub, "TRANSFORMERS_CACHE", str(tmp_path / "hub"), raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_lm_config("org/llama3").num_key_value_heads == 8
    with pytest.raises(ValueError, match="not in the Hugging Face cache and HF_HUB_OFFLINE"):
        load_lm_config("org/absent")


def test_a_failed_fetch_is_one_line_without_the_hubs_warnings(monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    """Offline, the hub client warns of each request it retries before it raises: the refusal
    says why in one line, and the hub's warnings stay off (no network is touched here)."""
    import logging

    def from_pretrained(name: str, local_files_only: bool = False, **kwargs: object) -> object:
        if not local_files_only:
            logging.getLogger("huggingface_hub.utils._http").warning("'refused' thrown while ...")
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", from_pretrained)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    level = logging.getLogger("huggingface_hub").level
    with pytest.raises(ValueError, match=r"^org/absent: no config.json .* fetching it failed \(We"):
        load_lm_config("org/absent")
    assert not [r for r in caplog.records if "thrown while" in r.getMessage()]
    assert logging.getLogger("huggingface_hub").level == level  # put back


def test_refusals_name_the_fix(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    bad = write_config(tmp_path / "bad", {"model_type": "nonesuch"})
    with pytest.raises(ValueError, match="model type 'nonesuch' is not one transformers"):
        load_lm_config(bad)
    with pytest.raises(ValueError, match="no causal-LM head"):
        load_lm_config(write_config(tmp_path / "vit", {"model_type": "vit"}))
    (tmp_path / "cut.json").write_text('{"model_type": "llama", ')  # a download cut short
    with pytest.raises(ValueError, match=r"cut.json: .*not a valid JSON file: give a model's"):
        load_lm_config(tmp_path / "cut.json")
    config = tiny()
    with pytest.raises(ValueError, match=r"longer than the model's 256 positions.*--seq-len 256"):
        plan_lm(config, LMSetup(seq_len=512), 8, "1GB", device="cpu")
    with pytest.raises(ValueError, match=r"matches no linear layer.*q_proj"):
        plan_lm(config, LMSetup(seq_len=16, lora_r=4, lora_targets="qkv"), 8, "1GB", device="cpu")
    with pytest.raises(ValueError, match=r"^--lora-targets names no module: give comma"):
        plan_lm(config, LMSetup(seq_len=16, lora_r=4, lora_targets=" , "), 8, "1GB", device="cpu")
    with pytest.raises(ValueError, match="add --lora R"):
        plan_lm(config, LMSetup(seq_len=16, quant=4), 8, "1GB", device="cpu")
    # The adapters' settings without adapters: not a full fine-tune planned in silence.
    for unused, named in [({"lora_targets": "q_proj"}, "--lora-targets"),
                          ({"lora_dropout": 0.05, "lora_alpha": 32}, "--lora-dropout, lora_alpha")]:  # fmt: skip
        with pytest.raises(
            ValueError, match=f"^{named} set LoRA's adapters and this plan has none"
        ):
            plan_lm(config, LMSetup(seq_len=16, **unused), 8, "1GB", device="cpu")
    with pytest.raises(ValueError, match="--no-double-quant is for a 4-bit base: add --qlora"):
        plan_lm(config, LMSetup(seq_len=16, lora_r=4, quant=8, double_quant=False), 8, "1GB",
                device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match=r"^--qlora-prep is for a quantized base .*add --qlora"):
        plan_lm(config, LMSetup(seq_len=16, lora_r=4, qlora_prep="trl"), 8, "1GB", device="cpu")
    with pytest.raises(ValueError, match=r"^--qlora-prep must be one of peft, trl, got 'x'"):
        plan_lm(config, LMSetup(seq_len=16, lora_r=4, quant=4, qlora_prep="x"), 8, "1GB")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # an import that fails
    with pytest.raises(ValueError, match=r"--qlora needs bitsandbytes.*pip install bitsandbytes"):
        plan_lm(config, LMSetup(seq_len=16, lora_r=4, quant=4), 8, "1GB", device="cpu")
    with pytest.raises(ValueError, match="multiple of the 2 ranks"):
        plan_lm(config, LMSetup(seq_len=16, world_size=2), 7, "1GB", device="cpu")


@pytest.mark.slow
def test_a_saved_plan_is_refused_when_it_is_not_one_or_is_newer(tmp_path: Path) -> None:
    """LMPlan.load reads back what LMPlan.save wrote and refuses, in one line with the fix, a
    file that is not a plan (a model's config, a file cut short), one a newer bigbatch wrote
    (a newer format, or fields added to this one) and one with a field missing."""
    plan = plan_lm(tiny(), LMSetup(seq_len=16, lora_r=4), 8, "1GB", device="cpu", overhead=0)
    saved = json.loads(plan.save(tmp_path / "plan.json").read_text())
    assert saved["format"] == "bigbatch language-model plan" and saved["version"] == 1
    assert LMPlan.load(tmp_path / "plan.json") == plan
    config = write_config(tmp_path / "m", tiny().to_dict()) / "config.json"
    (tmp_path / "cut.json").write_text(json.dumps(saved)[:200])
    newer, incomplete = dict(saved, version=2, bigbatch="9.0"), dict(saved)
    added = dict(saved, bigbatch="0.9", new_field=1)  # a newer plan of the same format
    del incomplete["sizes"]
    cases = [
        (config, "is not a bigbatch language-model plan"),
        (tmp_path / "cut.json", "is not a bigbatch language-model plan"),
        (newer, r"written by bigbatch 9.0 in plan format 2, newer .*pip install -U bigbatch"),
        (added, r"by bigbatch 0.9, with LMPlan's field\(s\) new_field that this .* upgrade"),
        (incomplete, r"incomplete or damaged plan \(KeyError: 'sizes'\): write it again"),
    ]
    for case, why in cases:
        path = case if isinstance(case, Path) else tmp_path / "case.json"
        if isinstance(case, dict):
            path.write_text(json.dumps(case))
        with pytest.raises(ValueError, match=why) as refused:
            LMPlan.load(path)
        assert "\n" not in str(refused.value)
    with pytest.raises(FileNotFoundError, match="--save"):
        LMPlan.load(tmp_path / "none.json")


@pytest.mark.slow
def test_an_uneven_last_micro_batch_is_said() -> None:
    """20 sequences at micro-batch 7 are 7, 7 and 6: the summary and a table's row say so, not
    7 x 3 alone."""
    plan = plan_lm(tiny(), LMSetup(seq_len=16), 8, "1GB", device="cpu", overhead=0)
    assert "micro-batch 8 x 1 accumulation;" in plan.summary()
    one = replace(plan.plan, micro_batch=7, micro_batches=3, target_batch=20)
    uneven = replace(plan, global_batch=20, plan=one)
    assert "20 sequences of 16 tokens a step = micro-batch 7 x 3 accumulation (the last 6);" in (
        uneven.summary()
    )
    from bigbatch.cli.plan_hf import _split  # a table's cell (--seq-len 512,1024)

    assert (_split(plan), _split(uneven)) == ("8 x 1", "7 x 3, last 6")


@pytest.mark.slow
def test_trainers_fused_adamw_is_planned_by_name(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--optimizer adamw_fused``: torch's fused AdamW, Trainer's default from torch 2.8, is
    planned as itself (no update temporaries: a lower peak than the multi-tensor AdamW's for
    a full fine-tune) and named to Trainer as ``adamw_torch_fused``."""
    # Wide enough that the weights, not the step's workspaces, decide the peak.
    wide = {**tiny().to_dict(), "hidden_size": 512, "intermediate_size": 2048}
    folder = write_config(tmp_path / "m", wide)
    args = ["plan", "--hf", str(folder), "--seq-len", "16", "--batch", "4", "--budget", "l4"]
    peaks = {}
    for optimizer in ("adamw", "adamw_fused"):
        assert main([*args, "--optimizer", optimizer, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        peaks[optimizer] = plan["peak_bytes_per_rank"]
    assert plan["trainer"]["optim"] == "adamw_torch_fused"
    assert peaks["adamw_fused"] < peaks["adamw"]


@pytest.mark.slow
def test_what_transformers_or_torch_refuse_is_one_line_with_the_fix(capfd) -> None:  # type: ignore[no-untyped-def]
    """A mixture of experts in float32 (grouped_mm takes 16-bit weights only, on the card as in
    the trace), an attention a model lacks, a config transformers cannot build; the one line
    alone (fake tensors' logged traceback of the refused kernel is not shown)."""
    moe = transformers.MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=256,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^mixtral's experts .* --dtype bf16"):
        plan_lm(moe, LMSetup(seq_len=16, dtype="fp32"), 2, "8GB")
    assert "Traceback" not in capfd.readouterr().err
    assert plan_lm(moe, LMSetup(seq_len=16, dtype="bf16"), 2, "8GB").micro_batch == 2
    # LoRA on it: none of peft's warnings of what it settles itself (its patterns for the
    # fused experts; fan_in_fan_out for GPT-2's Conv1D), which every such plan said.
    gpt2 = transformers.GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for config, dtype in ((moe, "bf16"), (gpt2, "auto")):
            lora = LMSetup(seq_len=16, dtype=dtype, lora_r=4)
            assert plan_lm(config, lora, 2, "8GB").micro_batch == 2
    assert not [w for w in caught if "peft" in w.filename], [str(w.message) for w in caught]
    if importlib.util.find_spec("bitsandbytes") is not None:
        with pytest.raises(ValueError, match=r"quantizes linear layers only.* without --qlora"):
            plan_lm(moe, LMSetup(seq_len=16, dtype="bf16", lora_r=4, quant=4), 2, "8GB")
    gemma2 = transformers.Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    sdpa = transformers.Gemma2PreTrainedModel._supports_sdpa  # False in transformers 5.23
    if not sdpa:
        with pytest.raises(ValueError, match=r"has no SDPA attention .* --attn eager"):
            plan_lm(gemma2, LMSetup(seq_len=16, attn="sdpa"), 2, "8GB")
    # Unnamed, the attention is from_pretrained's choice: what the run loads without one.
    chosen = plan_lm(gemma2, LMSetup(seq_len=16), 2, "8GB")
    assert chosen.setup.attn == ("sdpa" if sdpa else "eager") and chosen.micro_batch == 2
    broken = tiny(pad_token_id=9999)  # past the 512 embeddings
    with pytest.raises(ValueError, match=r"cannot build .* \(Padding_idx .*\): check its values"):
        plan_lm(broken, LMSetup(seq_len=16), 2, "8GB")
    # peft wraps Llama 4's router, an nn.Linear returning a tuple, and fails: here as in training.
    llama4 = transformers.Llama4TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, max_position_embeddings=256, dtype="bfloat16",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^peft's LoRA cannot wrap llama4_text's 'router' .*"
                       r"e\.g\. --lora-targets down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj "):  # fmt: skip
        plan_lm(llama4, LMSetup(seq_len=16, lora_r=4), 2, "8GB")
    targets = "q_proj,k_proj,v_proj,o_proj"
    assert plan_lm(llama4, LMSetup(seq_len=16, lora_r=4, lora_targets=targets), 2, "8GB")
    unset = tiny()
    unset.head_dim = None  # as ministral's config class leaves it where config.json has none
    with pytest.raises(ValueError, match=r"cannot build llama .*TypeError.* published config"):
        plan_lm(unset, LMSetup(seq_len=16), 2, "8GB")


@pytest.mark.slow
def test_a_vision_language_model_is_planned_from_its_text_config(tmp_path: Path) -> None:
    """Gemma 3 from 4B up (and Mistral 3, Llama 4) are vision-language models whose config keeps
    the vocabulary and positions in ``text_config``: a text fine-tune is planned with the
    vision tower's weights held."""
    text = {**tiny().to_dict(), "model_type": "gemma3_text", "head_dim": 16}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    folder = write_config(
        tmp_path / "gemma3",
        {"model_type": "gemma3", "text_config": text, "vision_config": vision,
         "mm_tokens_per_image": 4, "image_token_index": 500, "boi_token_index": 501,
         "eoi_token_index": 502},
    )  # fmt: skip
    config = load_lm_config(folder)
    plan = plan_lm(config, LMSetup(seq_len=64), 4, "2GB", device="cpu", overhead=0)
    assert plan.vocab == 512 and plan.micro_batch == 4
    text_only = plan_lm(load_lm_config(write_config(tmp_path / "text", text)), LMSetup(seq_len=64),
                        4, "2GB", device="cpu", overhead=0)  # fmt: skip
    assert plan.sizes.parameters > text_only.sizes.parameters  # the vision tower's
    with pytest.raises(ValueError, match="longer than the model's 256 positions"):
        plan_lm(config, LMSetup(seq_len=512), 4, "2GB", device="cpu", overhead=0)


def _fails_with(exc: BaseException):  # type: ignore[no-untyped-def]
    def fail(*args: object) -> None:
        raise exc

    return fail


@pytest.mark.slow
def test_a_model_with_its_own_code_is_planned_only_when_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A config whose auto_map names the model's own code (as a hub repository's does): refused
    in one line, never asked on the terminal; with --trust-remote-code, built by that code."""
    import transformers.dynamic_module_utils as dynamic

    import bigbatch.memory.lm as lm_module

    folder = write_config(
        tmp_path / "custom",
        {
            **tiny().to_dict(),
            "model_type": "bigbatch_custom",
            "architectures": ["CustomForCausalLM"],
            "auto_map": {
                "AutoConfig": "configuration_custom.CustomConfig",
                "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
            },
        },
    )
    (folder / "configuration_custom.py").write_text(
        "from transformers import LlamaConfig\n\n\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'bigbatch_custom'\n"
    )
    (folder / "modeling_custom.py").write_text(
        "from transformers import LlamaForCausalLM\n\n"
        "from .configuration_custom import CustomConfig\n\n\n"
        "class CustomForCausalLM(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    # transformers copies trusted code into its modules folder, and imports it from there.
    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked on the terminal"))
    args = ["plan", "--hf", str(folder), "--seq-len", "32", "--batch", "4", "--budget", "l4"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("add --trust-remote-code (trust_remote_code=True) "
                                             "if you trust its source")  # fmt: skip
    try:
        assert main([*args, "--trust-remote-code", "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["model_type"] == "bigbatch_custom" and plan["micro_batch"] == 4
        # Under a process group (torchrun's; a fake one here), an FSDP2 rank is traced apart,
        # built there by the same code, copied beside the config for that process.
        monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
        config = load_lm_config(folder, trust_remote_code=True)
        setup = LMSetup(seq_len=32, world_size=4, fsdp=True)
        alone = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0)
        with fake_ranks(2):
            apart = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0)
            monkeypatch.setattr(lm_module, "_own_code_beside", _fails_with(OSError("gone")))
            composed = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0)
        assert apart.fsdp_traced and "in a process of its own" in apart.notes[0]
        assert apart.peak_bytes == alone.peak_bytes and apart.model_type == "bigbatch_custom"
        assert not composed.fsdp_traced  # where the code cannot go with it: composed, and why
        assert (
            "not traced apart: its own code could not be copied for it (OSError: gone)"
            in (composed.notes[0])
        )
    finally:
        for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
            del sys.modules[name]  # the modules folder is gone with tmp_path


def test_cli_refuses_in_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    folder = write_config(tmp_path / "m", tiny().to_dict())
    args = ["plan", "--hf", str(folder), "--budget", "l4"]
    assert main([*args, "--seq-len", "4096", "--batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use --seq-len 256 or less" in err[0]
    assert main([*args, "--seq-len", "100", "--tokens", "1050"]) == 2
    assert "give a multiple of --seq-len" in capsys.readouterr().err
    assert main([*args, "--seq-len", "100", "--tokens", "1000", "--batch", "10"]) == 2
    assert "--batch and --tokens both give the global batch: give one" in capsys.readouterr().err
    assert main([*args, "--seq-len", "64", "--batch", "8", "--lora-targets", "q_proj"]) == 2
    assert "--lora-targets set LoRA's adapters and this plan has none" in capsys.readouterr().err
    # A field of the wrong type, as transformers 5 checks it while reading the config.
    mistyped = write_config(tmp_path / "mistyped", {**tiny().to_dict(), "intermediate_size": "128"})
    assert main(["plan", "--hf", str(mistyped), *args[3:], "--seq-len", "64", "--batch", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'intermediate_size'" in err[0] and "fix it in config.json" in err[0]
    # --save: one plan, into a folder that exists, refused before any planning.
    table = [*args, "--seq-len", "64,128", "--batch", "8", "--save", str(tmp_path / "p.json")]
    assert main(table) == 2
    assert "--save writes one plan: give one --seq-len" in capsys.readouterr().err
    nowhere = tmp_path / "no" / "p.json"
    assert main([*args, "--seq-len", "64", "--batch", "8", "--save", str(nowhere)]) == 2
    assert "give a file in an existing folder" in capsys.readouterr().err
    # Flags of the other kind of plan are refused, not ignored.
    assert main([*args, "--seq-len", "64", "--batch", "8", "--size", "32", "--confirm"]) == 2
    assert "--size, --confirm: not for a language model's plan" in capsys.readouterr().err
    assert (
        main(["plan", "--arch", "resnet18", "--batch", "8", "--budget", "l4", "--lora", "8"]) == 2
    )
    assert "--lora: for a language model's plan; add --hf" in capsys.readouterr().err


def test_quantized_storage_is_bitsandbytes_own() -> None:
    functional = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(300, 200, dtype=torch.bfloat16)
    for nested in (False, True):
        packed, state = functional.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                                 compress_statistics=nested)  # fmt: skip
        real = (
            packed.numel() * packed.element_size()
            + state.absmax.numel() * state.absmax.element_size()
        )
        if nested:
            real += sum(
                t.numel() * t.element_size() for t in (state.state2.absmax, state.state2.code)
            )
        layer = QuantizedLinear(200, 300, bits=4, nested=nested)
        mine = sum(t.numel() * t.element_size() for t in (*layer.parameters(), *layer.buffers()))
        assert mine == real == quantized_bytes(300, 200, bits=4, nested=nested)


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        LMSetup(seq_len=64, lora_r=8, gradient_checkpointing=True),
        LMSetup(seq_len=64, lora_r=8, quant=4),
        LMSetup(seq_len=64, lora_r=8, quant=4, qlora_prep="trl"),
        LMSetup(seq_len=64, lora_r=8, quant=8),
        LMSetup(seq_len=64),
        LMSetup(seq_len=32, lora_r=8, packing=True, attn="eager"),
        LMSetup(seq_len=64, lora_r=8, attn="flash_attention_2"),
    ],
    ids=["lora-ckpt", "qlora", "qlora-trl", "int8", "full", "packed", "flash-padded"],
)
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_cpu_peak_predicted_as_measured(setup: LMSetup, optimizer: str) -> None:
    if setup.quant:
        pytest.importorskip("bitsandbytes")
    spec = lm_spec_at(tiny(), setup, device="cpu", precision="fp32", optimizer=optimizer)(4)
    predicted, measured = predict_peak(spec).peak_bytes, measure_step_peak(spec)
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "micro_batch"),
    [
        (LMSetup(seq_len=64, lora_r=8, packing=True), 8),  # a block-diagonal mask
        (LMSetup(seq_len=256, lora_r=8), 1),  # no padding: no mask (SDPA's is_causal)
    ],
    ids=["packed", "unpadded"],
)
def test_sdpa_masks_are_those_of_the_real_step(
    setup: LMSetup, micro_batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers cannot read a fake tensor's values, so it cannot tell packed position ids
    or a padding mask of all ones; the planner's batches say what their values are
    (fake_branches.known_values). Without that (the control), the packed rows' mask is missed
    and the unpadded row gets a mask the real step skips: over 10 % either way here."""
    from bigbatch.memory import lm_model

    spec = lm_spec_at(tiny(), setup, device="cpu", precision="fp32")(micro_batch)
    measured = measure_step_peak(spec)
    predicted = predict_peak(spec).peak_bytes
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)
    monkeypatch.setattr(lm_model, "known_values", lambda tensor, values: tensor)
    unknown = predict_peak(lm_spec_at(tiny(), setup, device="cpu", precision="fp32")(micro_batch))
    assert abs(unknown.peak_bytes - measured) / measured > 0.1, (unknown.peak_bytes, measured)


@pytest.mark.slow
def test_a_plan_that_pads_does_not_hold_the_same_sequences_in_one_row() -> None:
    """Why a padded plan refuses packed runs (bigbatch.integrations.hf_plan._check_packing):
    SDPA's mask over one row of 8 sequences spans the row, 8 times a padded micro-batch's
    masks: the step's peak 1.76x the padded one's at 256 tokens here (more for longer
    sequences: the masks grow with their square). flash_attention_2 reads the sequences'
    bounds from the positions and takes no mask: its one row holds no more than the padded
    micro-batch, and is traced as one sequence of the row's length is."""

    def peak(packing: bool, attn: str) -> int:
        setup = LMSetup(seq_len=256, packing=packing, attn=attn)
        return predict_peak(lm_spec_at(tiny(), setup, precision="fp32")(8)).peak_bytes

    padded, one_row = peak(False, "sdpa"), peak(True, "sdpa")
    assert one_row > 1.5 * padded, (one_row, padded)
    flash_padded, flash_row = peak(False, "flash_attention_2"), peak(True, "flash_attention_2")
    assert flash_row <= flash_padded < one_row, (flash_row, flash_padded, one_row)
    # FA2's row is traced as one sequence of the row's length is (SDPA's causal kernel, no mask).
    two = LMSetup(seq_len=128, packing=True, attn="flash_attention_2")
    row = predict_peak(lm_spec_at(tiny(), two, precision="fp32")(2)).peak_bytes
    one = predict_peak(lm_spec_at(tiny(), LMSetup(seq_len=256), precision="fp32")(1)).peak_bytes
    assert abs(row - one) <= 0.01 * one, (row, one)


@pytest.mark.slow
def test_flash_attention_2_is_traced_with_the_copies_transformers_makes_around_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """flash_attention_2 needs flash-attn and a GPU: the trace runs transformers' wrapper
    around SDPA's flash kernel (lm_attention.py). Against transformers' own wrapper
    (_flash_attention_forward, flash-attn's functions stood in by the same kernel) on a padded
    micro-batch: the same loss, the same bytes saved for the backward, the same peak. SDPA's
    padded step, as a flash_attention_2 plan was traced before, saves a mask a layer and the
    key-value heads repeated instead of the gathered copies: 8 % more here."""
    from bigbatch.memory.lm_attention import _kernel
    from bigbatch.memory.lm_model import lm_factory
    from bigbatch.memory.measure import profiled_peak

    fau = importlib.import_module("transformers.modeling_flash_attention_utils")
    loading = ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_pad_fn", "_unpad_fn",
               "_process_flash_kwargs_fn", "_lazy_define_process_function")  # fmt: skip
    if not all(hasattr(fau, name) for name in loading):
        pytest.skip(f"transformers {transformers.__version__} loads flash-attn otherwise")

    Tensor = torch.Tensor

    def varlen(
        q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None = None, **_: object
    ) -> Tensor:
        return _kernel(q[None], k[None], v[None], softmax_scale)[0]

    def dense(
        q: Tensor, k: Tensor, v: Tensor, softmax_scale: float | None = None, **_: object
    ) -> Tensor:
        return _kernel(q, k, v, softmax_scale)

    stood_in = {"_loaded_implementation": "flash_attention_2", "_flash_fn": dense,
                "_flash_varlen_fn": varlen, "_pad_fn": fau._pad_input,
                "_unpad_fn": fau._unpad_input,
                "_process_flash_kwargs_fn": fau._lazy_define_process_function(varlen)}  # fmt: skip
    for name, value in stood_in.items():
        monkeypatch.setattr(fau, name, value)
    torch.manual_seed(0)
    ours = lm_factory(tiny(), LMSetup(seq_len=64, attn="flash_attention_2"))()  # the plan's
    models = {"ours": ours}
    for attn in ("flash_attention_2", "sdpa"):
        # Built as SDPA (flash-attn is not installed), run as flash_attention_2.
        models[attn] = transformers.AutoModelForCausalLM.from_config(
            tiny(), attn_implementation="sdpa"
        )
        models[attn].load_state_dict(ours.state_dict())
        models[attn].config._attn_implementation = attn
    ids = torch.randint(0, 512, (3, 64))
    mask = torch.ones_like(ids)
    mask[1, 50:], mask[2, 20:] = 0, 0

    def run(model: torch.nn.Module) -> tuple[float, int, int]:
        storages: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        def step() -> torch.Tensor:
            return model(input_ids=ids, attention_mask=mask, labels=ids).loss

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = step().item()
        return loss, sum(storages.values()), profiled_peak(lambda: step().backward())

    ours_run, theirs, sdpa = (run(models[m]) for m in ("ours", "flash_attention_2", "sdpa"))
    assert ours_run == theirs, (ours_run, theirs)
    assert sdpa[1] > 1.05 * theirs[1] and sdpa[2] > 1.05 * theirs[2], (sdpa, theirs)


def test_a_quantized_base_without_autocast_hands_flash_attention_its_configs_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without autocast (Trainer's bf16 off), peft's float32 norms make a QLoRA layer's
    queries float32, and transformers' flash_attention_2 wrapper copies them in the quantized
    model's config dtype, as its quantizer marks the model: the traced model is marked too, so
    the copies are 16-bit, not the weights' (packed bytes) nor float32."""
    import bigbatch.memory.lm_attention as lm_attention
    from bigbatch.memory.lm_model import lm_factory

    kernel, dtypes = lm_attention._kernel, []

    def recording(q: torch.Tensor, *rest: Any) -> torch.Tensor:
        dtypes.append(q.dtype)
        return kernel(q, *rest)

    monkeypatch.setattr(lm_attention, "_kernel", recording)
    setup = LMSetup(seq_len=16, lora_r=4, quant=4, attn="flash_attention_2", dtype="bf16")
    model = lm_factory(tiny(), setup)()
    assert model.config._is_quantized and model.config.dtype == torch.bfloat16
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert dtypes == [torch.bfloat16] * 2, dtypes  # a layer each


def test_building_the_adapters_warns_about_nothing_the_user_can_change() -> None:
    """peft reads transformers' renamed checkpointing property when it wraps the planner's
    stand-in model: a FutureWarning a Python user of plan_lm could do nothing about."""
    import warnings

    spec = lm_spec_at(tiny(), LMSetup(seq_len=8, lora_r=4, gradient_checkpointing=True))(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        build_on_meta(spec.model)


def test_peft_adapters_and_the_four_bit_base_are_counted() -> None:
    model = build_on_meta(lm_spec_at(tiny(), LMSetup(seq_len=8, lora_r=4, quant=4))(1).model)
    sizes = model_sizes(model)
    # r x (in + out) per adapted layer: q 64+64, k 64+32, v 64+32, o 64+64, gate/up/down 64+128
    assert sizes.trainable_count == 2 * 4 * (128 + 96 + 96 + 128 + 3 * 192)
    assert sizes.trainable == 4 * sizes.trainable_count  # peft's adapters in float32
    layers = model.base_model.model.model.layers
    assert sum(isinstance(m, QuantizedLinear) for m in layers.modules()) == 14
    assert not isinstance(
        model.base_model.model.lm_head, QuantizedLinear
    )  # kept, as transformers does


@pytest.mark.slow
@pytest.mark.parametrize(
    ("values", "setup", "card", "trainable"),
    [
        (
            LLAMA3_8B,
            LMSetup(seq_len=2048, lora_r=16, gradient_checkpointing=True),
            "rtx4090",
            41_943_040,
        ),
        (
            QWEN25_7B,
            LMSetup(seq_len=1024, lora_r=16, quant=4, gradient_checkpointing=True),
            "t4",
            40_370_176,
        ),
    ],
    ids=["llama3-8b-lora-24gb", "qwen2.5-7b-qlora-16gb"],
)
def test_seven_and_eight_billion_parameter_plans(
    tmp_path: Path, capsys, values, setup, card, trainable
) -> None:  # type: ignore[no-untyped-def]
    """The trainable counts are those peft prints for these models with r=16 on all linear
    layers; the plan keeps the global batch, and its peak stays under the card's budget."""
    if setup.quant:
        pytest.importorskip("bitsandbytes")
    folder = write_config(tmp_path / "m", values)
    # A global batch of 4: micro-batch 1 fits and 2 does not on these cards, and the search
    # has fewer steps to trace (each a 7-8B model's: seconds).
    args = ["plan", "--hf", str(folder), "--seq-len", str(setup.seq_len), "--batch", "4"]
    args += ["--budget", card, "--lora", "16", "--gradient-checkpointing", "--json"]
    args += ["--qlora"] if setup.quant else []
    assert main([*args, "--save", str(tmp_path / "plan.json")]) == 0
    plan = json.loads(capsys.readouterr().out)
    saved = LMPlan.load(tmp_path / "plan.json")  # the plan the training job loads
    assert saved.to_dict() == {
        k: v for k, v in plan.items() if k not in ("fits", "trainer", "model")
    }
    assert plan["trainer"] == {
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 4,
        "per_device_eval_batch_size": plan["eval_batch"],
        "bf16": card != "t4",
        "fp16": card == "t4",
        "optim": "adamw_torch_fused",  # Trainer's default: the adamw plan holds for it
        "activation_checkpointing": True,  # the plan counts on it
    }  # fmt: skip  (a T4 has no bfloat16 units: fp16 there)
    # The model as the plan traced it: the 4-bit layers compute in the T4's fp16 weights' dtype.
    half = "float16" if card == "t4" else "bfloat16"
    assert plan["model"]["dtype"] == half and plan["model"]["attn_implementation"] == "sdpa"
    quant = plan["model"].get("quantization_config", "")
    assert (f"bnb_4bit_compute_dtype=torch.{half})" in quant) == bool(setup.quant)
    # Evaluation's logits (and their float32 copy) at this length: Trainer's default of 8
    # sequences a forward pass would not fit beside the weights.
    assert 1 <= plan["eval_batch"] < 8 and plan["eval_peak_bytes_per_rank"] <= plan["usable_bytes"]
    assert saved.source == str(folder)
    assert plan["trainable_parameters"] == trainable
    assert plan["micro_batch"] * plan["accumulation"] == 4
    assert plan["peak_bytes_per_rank"] <= plan["usable_bytes"]
    parts = plan["parts"]
    assert parts["adapters"] == 4 * trainable and parts["logits"] > 0
    if setup.quant:  # 4-bit layers, and the embeddings and head in float32
        assert plan["parameters"] == 7_615_616_512 + trainable  # as peft prints it
        assert parts["weights"] < 0.55 * 2 * plan["parameters"]
    else:  # bfloat16
        assert abs(parts["weights"] - 2 * (plan["parameters"] - trainable)) < 2**20
    assert not [n for n in plan["notes"] if "has no bfloat16 units" in n]  # fp16 on a T4


@pytest.mark.slow
def test_a_qlora_plan_names_the_model_to_load_where_bitsandbytes_is_missing(
    tmp_path: Path, capsys, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The plan's last line says how to load the model it traced: a T4's QLoRA computes in
    fp16. It is said without building transformers' BitsAndBytesConfig, which releases before
    5 refuse where bitsandbytes is not installed (a Mac planning for the card)."""
    transformers = pytest.importorskip("transformers")

    def missing(**kwargs: object) -> None:
        raise importlib.metadata.PackageNotFoundError("bitsandbytes")

    monkeypatch.setattr(transformers, "BitsAndBytesConfig", missing)
    folder = write_config(tmp_path / "m", tiny().to_dict() | {"dtype": "bfloat16"})
    args = ["plan", "--hf", str(folder), "--seq-len", "16", "--batch", "2", "--lora", "4"]
    assert main([*args, "--qlora", "--budget", "t4"]) == 0
    model, adapters = capsys.readouterr().out.splitlines()[-2:]
    assert model == (
        "The model (from_pretrained(..., **model_arguments(plan)) loads it so): "
        "dtype=torch.float16, attn_implementation='sdpa', quantization_config=BitsAndBytesConfig("
        "load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, "
        "bnb_4bit_compute_dtype=torch.float16)"
    )
    # And how its adapters are readied, as planned: peft's, unless --qlora-prep trl.
    assert adapters.startswith(
        "Its adapters, as planned: get_peft_model(prepare_model_for_kbit_training(model), "
    )
    assert main([*args, "--qlora", "--budget", "t4", "--qlora-prep", "trl"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "Its adapters, as planned: SFTTrainer(model, ..., peft_config=lora_config(plan.setup)) "
        "(TRL 1.x)"
    )


@pytest.mark.slow
def test_a_plan_says_what_its_loss_makes(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Where the logits are a tenth of the peak or more, a plan of the model's own loss points
    SFTTrainer's users to --loss trl, whose plan holds no logits (its parts say none);
    --label-smoothing is planned (the fine-tune's line says so) and the arguments it holds for
    name the factor. A factor Trainer does not take, or the flag without --hf, is refused in
    one line."""
    folder = write_config(tmp_path / "m", {**tiny().to_dict(), "vocab_size": 32_000})
    args = ["plan", "--hf", str(folder), "--seq-len", "128", "--batch", "4", "--budget", "4GB"]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[3].startswith("For TRL's SFTTrainer, plan with --loss trl: its fused LM head ")
    assert main([*args, "--loss", "trl"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "logits" not in out[1] and not out[3].startswith("For TRL's")
    assert main([*args, "--label-smoothing", "0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("128 tokens, padded, label smoothing 0.1")
    assert out[2].endswith(", label_smoothing_factor=0.1") and not out[3].startswith("For TRL")
    assert main([*args, "--label-smoothing", "1"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--label-smoothing must be at least 0 and below 1 (Trainer's label_smoothing_factor, "
            "0.1 say), got 1.0"
        )
    )
    assert main(["plan", "--arch", "resnet18", "--batch", "8", "--label-smoothing", "0.1"]) == 2
    assert "--label-smoothing: for a language model's plan" in capsys.readouterr().err


@pytest.mark.slow
def test_a_card_without_bfloat16_units_gets_the_fp16_recipe() -> None:
    """A T4 (compute capability 7.5) emulates bf16, several times slower than fp16 in the same
    memory: the plan says how to train in fp16 (a full fine-tune keeps float32 weights, which
    GradScaler needs)."""

    def emulated(setup: LMSetup, card: str = "t4", precision: str = "bf16") -> list[str]:
        plan = plan_lm(tiny(), setup, 2, card, precision=precision)
        return [n for n in plan.notes if "T4 (compute capability 7.5) has no bfloat16" in n]

    lora = emulated(LMSetup(seq_len=16, lora_r=4))
    assert len(lora) == 1 and lora[0].endswith(
        "--precision fp16 (Trainer's fp16=True), --dtype fp16 for the frozen base"
    )
    assert emulated(LMSetup(seq_len=16))[0].endswith("--dtype fp32 weights")
    assert emulated(LMSetup(seq_len=16, lora_r=4, dtype="fp16"), precision="fp16") == []
    assert emulated(LMSetup(seq_len=16, dtype="bf16"), precision="fp16") != []  # the weights
    assert emulated(LMSetup(seq_len=16, lora_r=4), card="l4") == []


def test_flash_attention_2_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attention_2 runs on Ampere or newer alone (not a T4's 7.5), on CUDA alone (not a
    CPU), in 16-bit alone: each refused before anything is traced."""
    with pytest.raises(
        ValueError, match=r"Ampere or newer .* the T4 is 7.5: plan with --attn sdpa"
    ):
        plan_lm(tiny(), LMSetup(seq_len=16, attn="flash_attention_2"), 2, "t4")
    # Under "auto", this process's GPU: a T4, simulated (refused before its memory is read).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(ValueError, match=r"Ampere or newer .* this GPU is 7.5: plan with --attn"):
        plan_lm(tiny(), LMSetup(seq_len=16, attn="flash_attention_2"), 2, "auto")
    monkeypatch.undo()
    # Nor on a CPU (or MPS): flash-attn's kernels are CUDA's.
    with pytest.raises(ValueError, match=r"^flash_attention_2 runs on CUDA GPUs alone .* this "
                       r"plan is for cpu: plan with --attn sdpa, or for the GPU with --device "
                       r"cuda$"):  # fmt: skip
        plan_lm(tiny(), LMSetup(seq_len=16, attn="flash_attention_2"), 2, "1GB", device="cpu")
    # Nor in float32 (float32 weights without autocast: flash-attn takes 16-bit inputs).
    flash = LMSetup(seq_len=16, attn="flash_attention_2")
    with pytest.raises(ValueError, match=r"^flash_attention_2 computes in float16 or bfloat16 "
                       r"alone, .*: plan with --precision bf16 \(Trainer's bf16=True\), or "
                       r"--dtype bf16, or --attn sdpa$"):  # fmt: skip
        plan_lm(tiny(), flash, 2, "a100", precision="fp32")
    # A quantized base's float32 inputs go in its config's dtype: float32 here.
    with pytest.raises(ValueError, match=r"^flash_attention_2 computes in float16 or bfloat16"):
        plan_lm(tiny(), replace(flash, lora_r=4, quant=4), 2, "a100", precision="fp32")


@pytest.mark.slow
def test_a_plan_for_a_card_without_bfloat16_units_takes_fp16_unless_told(
    tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    """A Kaggle T4: where --precision is not given, the plan is in fp16 (Trainer's fp16=True),
    the config's bf16 weights in fp16 under LoRA and in float32 for a full fine-tune, said on
    stderr; an explicit bf16 is planned with the note; an L4 (Ada) keeps bf16."""
    folder = write_config(tmp_path / "m", tiny().to_dict() | {"dtype": "bfloat16"})

    def plan(*flags: str) -> tuple[dict, str]:  # type: ignore[type-arg]
        args = ["plan", "--hf", str(folder), "--seq-len", "16", "--batch", "2", "--json"]
        assert main([*args, *flags]) == 0
        said = capsys.readouterr()
        return json.loads(said.out), said.err

    lora, err = plan("--budget", "t4", "--lora", "4")
    assert "planned for the T4: --precision fp16 --dtype fp16 (it has no bfloat16 units" in err
    assert lora["trainer"]["fp16"] and not lora["trainer"]["bf16"]
    assert lora["dtype"] == "fp16" and lora["setup"].endswith("fp16 weights") and not lora["notes"]
    full, err = plan("--budget", "t4")
    assert "--precision fp16 --dtype fp32" in err and full["dtype"] == "fp32"
    told, err = plan("--budget", "t4", "--lora", "4", "--precision", "bf16")
    assert "planned for" not in err and told["trainer"]["bf16"]
    assert any("has no bfloat16 units" in n for n in told["notes"])
    given, err = plan("--budget", "t4", "--lora", "4", "--precision", "fp16")
    assert (
        given["dtype"] == "fp16"
        and "planned for the T4: --dtype fp16" in err
        and "--dtype bf16 plans that" in err
    )
    ada, err = plan("--budget", "l4", "--lora", "4")
    assert "planned for" not in err and ada["trainer"]["bf16"] and ada["dtype"] == "auto"
    # A config in float16: kept under LoRA; float32 for a full fine-tune, whose float16
    # gradients GradScaler cannot unscale (planned so by hand: refused with the fix).
    write_config(tmp_path / "m", tiny().to_dict() | {"dtype": "float16"})
    lora16, err = plan("--budget", "t4", "--lora", "4")
    assert "planned for the T4: --precision fp16 (" in err and lora16["dtype"] == "auto"
    full16, err = plan("--budget", "t4")
    assert "planned for the T4: --precision fp16 --dtype fp32" in err and full16["dtype"] == "fp32"
    with pytest.raises(ValueError, match=r"^a full fine-tune of float16 weights in fp16: torch's "
                       r"GradScaler cannot unscale float16 gradients .*--dtype fp32"):  # fmt: skip
        plan_lm(tiny(), LMSetup(seq_len=16, dtype="fp16"), 2, "t4", precision="fp16")


@pytest.mark.slow
def test_a_config_naming_no_dtype_is_planned_in_float32_and_the_plan_says_so() -> None:
    """transformers' default configs and hand-written ones often name no dtype: the weights are
    planned in float32, as from_pretrained loads them, twice a 16-bit checkpoint's bytes; the
    plan says so, and a LoRA base that does not fit is first told to try 16 bits."""

    def plan(config: object, setup: LMSetup, budget: str = "2GB") -> LMPlan:
        return plan_lm(config, setup, 2, budget, device="cpu", precision="fp32", overhead=0)

    config = tiny()
    plain = plan(config, LMSetup(seq_len=16, lora_r=4))
    assert plain.weights_dtype == "float32"
    assert config.dtype is None and config.use_cache  # the user's config is left as it was
    assert [n for n in plain.notes if "names no dtype" in n] == [
        "the config names no dtype: the weights are planned in float32 (as from_pretrained "
        "loads them without one); plan a 16-bit checkpoint with --dtype bf16 or --dtype fp16"
    ]
    for named in (plan(tiny(dtype="bfloat16"), LMSetup(seq_len=16, lora_r=4)),
                  plan(tiny(), LMSetup(seq_len=16, lora_r=4, dtype="fp32"))):  # fmt: skip
        assert not [n for n in named.notes if "names no dtype" in n]
    fix = r"\. Try --gradient-checkpointing, --dtype bf16 or fp16 \(the frozen base is float32 now\), --qlora"
    with pytest.raises(DoesNotFitError, match=fix):
        plan(tiny(), LMSetup(seq_len=16, lora_r=4), "64KB")
    with pytest.raises(DoesNotFitError, match=r"\. Try --gradient-checkpointing, --qlora"):
        plan(tiny(dtype="bfloat16"), LMSetup(seq_len=16, lora_r=4), "64KB")


@pytest.mark.slow
def test_bf16_eight_billion_lora_does_not_fit_sixteen_gigabytes(tmp_path: Path) -> None:
    config = load_lm_config(write_config(tmp_path / "m", LLAMA3_8B))
    with pytest.raises(DoesNotFitError, match=r"does not fit even at micro-batch 1.*--qlora"):
        plan_lm(config, LMSetup(seq_len=512, lora_r=16, gradient_checkpointing=True), 8, "t4")


@pytest.mark.slow
def test_ranks_share_the_global_batch_and_fsdp_shards_the_weights() -> None:
    config = tiny()
    one = plan_lm(config, LMSetup(seq_len=64), 8, "2GB", device="cpu", overhead=0)
    ddp = plan_lm(config, LMSetup(seq_len=64, world_size=2), 8, "2GB", device="cpu", overhead=0)
    fsdp = plan_lm(config, LMSetup(seq_len=64, world_size=4, fsdp=True), 8, "2GB", device="cpu",
                   overhead=0)  # fmt: skip
    assert one.plan.target_batch == 8 and ddp.plan.target_batch == 4 and fsdp.plan.target_batch == 2
    assert ddp.per_rank_extra_bytes == ddp.sizes.trainable  # DDP's gradient buckets
    assert fsdp.fsdp_traced and fsdp.per_rank_extra_bytes == 0  # one rank, traced
    assert "FSDP2 over 4 ranks, traced as one rank" in fsdp.notes[0]
    # Evaluation: planned for DDP's ranks as for one, and for an FSDP2 rank as it runs.
    assert one.evaluation is not None and ddp.evaluation is not None
    assert fsdp.evaluation is not None and fsdp.eval_batch == 2  # a rank's share, at most
    assert fsdp.to_dict()["eval_peak_bytes_per_rank"] == fsdp.evaluation.predicted_peak_bytes
    # NCCL's buffers are outside the allocator and the trace: a CUDA plan over ranks says so.
    cuda = plan_lm(config, LMSetup(seq_len=64, world_size=2), 8, "h100", device="cuda")
    assert any("NCCL" in n for n in cuda.notes) and not any("NCCL" in n for n in ddp.notes)
    # Under torchrun (a process group already there), not traced apart (apart=False: see
    # test_under_a_process_group_an_fsdp2_rank_is_traced_apart), the ranks are composed onto
    # one trace.
    with fake_ranks(2):
        composed = plan_lm(config, LMSetup(seq_len=64, world_size=4, fsdp=True), 8, "2GB",
                           device="cpu", overhead=0, apart=False)  # fmt: skip
        alone = plan_lm(config, LMSetup(seq_len=64, world_size=4, fsdp=True), 8, "2GB",
                        device="cpu", overhead=0, evaluation=False, apart=False)  # fmt: skip
        with pytest.raises(RuntimeError, match="plan before init_process_group"), fake_ranks(2):
            pass
    assert not composed.fsdp_traced and composed.per_rank_extra_bytes < 0
    assert "composed onto one process's trace" in composed.notes[0]
    # Its evaluation is composed as its training is, without gradients: on the safe side of
    # the traced rank's (how close: test_an_fsdp2_rank_is_traced_as_it_runs).
    assert composed.evaluation is not None and composed.eval_batch == fsdp.eval_batch == 2
    assert "evaluation's forward passes composed the same way" in composed.notes[0]
    # Training alone: the same composition, and no word of an evaluation it did not plan.
    assert alone.evaluation is None and alone.peak_bytes == composed.peak_bytes
    assert "composed onto one process's trace" in alone.notes[0]
    assert "evaluation" not in alone.notes[0]
    assert fsdp.eval_peak_bytes is not None and composed.eval_peak_bytes is not None
    assert composed.eval_peak_bytes >= fsdp.eval_peak_bytes
    # A rank's usable memory is the budget's, whatever the rank holds beyond the trace.
    reported = [plan.to_dict() for plan in (one, ddp, fsdp, composed)]
    assert len({r["usable_bytes"] for r in reported}) == 1
    assert all(r["peak_bytes_per_rank"] <= r["usable_bytes"] <= r["budget_bytes"] for r in reported)


@pytest.mark.slow
def test_under_a_process_group_an_fsdp2_rank_is_traced_apart(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the planning process has a process group (torchrun's, once Trainer's arguments are
    made; a fake one here), an FSDP2 rank is traced in a process of its own: the plan a process
    without one makes, not the composition's over-count. What does not fit there raises here;
    where that process cannot run, the ranks are composed and the plan says why."""
    import bigbatch.memory.lm as lm_module

    config, setup = tiny(), LMSetup(seq_len=64, world_size=4, fsdp=True)
    # An auto_map for a model transformers builds itself, as many hub repositories keep theirs.
    config.auto_map = {"AutoConfig": "configuration_llama.LlamaConfig"}
    alone = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0)
    with fake_ranks(2):
        apart = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0)
        composed = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0, apart=False)
        with pytest.raises(DoesNotFitError, match="does not fit even at micro-batch 1") as caught:
            plan_lm(config, setup, 8, "1MB", device="cpu", overhead=0)
        assert caught.value.floor.peak_bytes > 0  # the floor's breakdown, read back
        monkeypatch.setattr(lm_module, "_run_apart", lambda folder: "the process failed (X)")
        fallback = plan_lm(config, setup, 8, "2GB", device="cpu", overhead=0)
    assert apart.fsdp_traced and apart.per_rank_extra_bytes == 0
    assert "(in a process of its own: this one has a process group already)" in apart.notes[0]
    got, want = apart.to_dict(), alone.to_dict()
    assert {k: v for k, v in got.items() if k != "notes"} == {
        k: v for k, v in want.items() if k != "notes"
    }
    assert apart.eval_batch == alone.eval_batch and apart.peak_bytes < composed.peak_bytes
    assert not fallback.fsdp_traced and fallback.peak_bytes == composed.peak_bytes
    assert "; not traced apart: the process failed (X)" in fallback.notes[0]


def fsdp_config() -> transformers.LlamaConfig:
    """A Llama whose weights matter beside its activations (4 x 0.98 M a layer, 1.05 M the
    root's embeddings, head and norm)."""
    return transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "precision"),
    [
        (LMSetup(seq_len=64, world_size=2, fsdp=True), "fp32"),
        (LMSetup(seq_len=64, lora_r=8, gradient_checkpointing=True, world_size=4, fsdp=True),
         "fp32"),
        (LMSetup(seq_len=64, world_size=2, fsdp=True, dtype="bf16"), "bf16"),
        (LMSetup(seq_len=64, lora_r=8, quant=4, world_size=2, fsdp=True, dtype="bf16",
                 quant_storage="uint8"), "bf16"),
        (LMSetup(seq_len=64, lora_r=8, quant=4, world_size=2, fsdp=True, dtype="bf16"), "bf16"),
    ],
    ids=["full-2-ranks", "lora-ckpt-4-ranks", "full-bf16-2-ranks", "qlora-uint8-2-ranks",
         "qlora-bf16-storage-2-ranks"],
)  # fmt: skip
def test_an_fsdp2_rank_is_traced_as_it_runs(setup: LMSetup, precision: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One FSDP2 rank's step (prepared as Trainer's accelerate prepares it), traced on a fake
    process group, against the same step really run on it (collectives that move no data; the
    memory is the rank's own); its evaluation's forward without gradients too (each layer's
    gathered weights freed after it, as FSDP2 does: the control, not following those frees,
    was 44-56 % over). Composing the ranks onto one process's trace instead (the control) is 18 %
    over for the full fine-tune: its optimizer step's temporaries and the moment of its peak
    are one process's, not a rank's. In bf16, accelerate's float32 masters of a full
    fine-tune's weights and a QLoRA base's 4-bit weights left whole on each rank are what the
    rank holds."""
    config = fsdp_config()
    spec = lm_spec_at(config, setup, device="cpu", precision=precision, sharded=True)(2)
    with fake_ranks(setup.world_size):
        predicted, measured = predict_peak(spec).peak_bytes, measure_step_peak(spec)
        evaluating = predict_evaluation_peak(spec, state_copies=0).peak_bytes
        model = spec.model().eval()
        x = make_inputs(spec, torch.device("cpu"))
        with torch.no_grad():
            evaluated = measure_peak(
                lambda: run_step_loss(spec, model, x, "cpu"),
                alive=[*model.parameters(), *model.buffers()],
            )
    assert abs(predicted - measured) / measured <= 0.01, (predicted, measured)
    assert abs(evaluating - evaluated) / evaluated <= 0.01, (evaluating, evaluated)
    import bigbatch.memory.evaluate

    monkeypatch.setattr(bigbatch.memory.evaluate, "storage_resizes", lambda _: nullcontext())
    with fake_ranks(setup.world_size):
        blind = predict_evaluation_peak(spec, state_copies=0).peak_bytes
    # A QLoRA base's packed weights are never gathered: what is freed is less there.
    assert blind / evaluated > (1.1 if setup.quant else 1.3), (blind, evaluated)
    # Composed onto one process's trace (a plan made under torchrun), evaluation's forward is
    # over the rank's, never under: by 10-46 % here (the most for a QLoRA base packed in bf16).
    one = lm_spec_at(config, replace(setup, world_size=1, fsdp=False), device="cpu",
                     precision=precision)(2)  # fmt: skip
    sizes = model_sizes(build_on_meta(one.model))
    alone = predict_evaluation_peak(one, state_copies=0)
    extra, _ = per_rank_bytes(sizes, alone.parts(), setup, mixed_precision=precision == "bf16",
                              state_copies=0, evaluation=True)  # fmt: skip
    assert 1.0 <= (alone.peak_bytes + extra) / evaluated < 1.5, alone.peak_bytes + extra
    if not setup.lora_r and precision == "fp32":
        floor = predict_peak(one)
        extra, _ = per_rank_bytes(sizes, floor.parts(), setup)
        assert (floor.peak_bytes + extra) / measured > 1.1, (floor.peak_bytes + extra, measured)


@pytest.mark.slow
def test_fsdp2_ranks_are_planned_as_trainers_accelerate_prepares_them(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Under Trainer's bf16, accelerate keeps float32 masters of the weights that train (FSDP2
    needs one dtype a unit; its mixed-precision policy gathers them in bf16), and leaves a
    QLoRA base's packed 4-bit weights out of the sharding, whole on each rank. A rank's plan
    holds both. The control: the same step sharded in the weights' own dtype (torch's
    fully_shard alone) plans a full fine-tune's rank under a third below what it holds."""
    from bigbatch.memory import fsdp
    from bigbatch.memory.budget import format_bytes

    assert fsdp.trainer_sharding()  # accelerate is installed: its preparation is what runs
    config = fsdp_config()
    full = LMSetup(seq_len=64, world_size=2, fsdp=True, dtype="bf16")
    spec = lm_spec_at(config, full, device="cpu", precision="bf16", sharded=True)(2)
    with fake_ranks(2):
        model = spec.model()
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # the masters
        held, planned = measure_step_peak(spec), predict_peak(spec).peak_bytes
    assert abs(planned - held) / held <= 0.01, (planned, held)
    monkeypatch.setattr("bigbatch.memory.lm_model.trainer_sharding", lambda: False)
    with fake_ranks(2):
        own_dtype = predict_peak(spec).peak_bytes
    assert own_dtype / held < 0.75, (own_dtype, held)
    monkeypatch.undo()
    # Composed onto one process's trace (under torchrun, apart=False): the masters are added,
    # and the rank's peak is not under what it holds.
    with fake_ranks(2):
        composed = plan_lm(config, full, 4, "1GB", device="cpu", precision="bf16", overhead=0,
                           apart=False)  # fmt: skip
    assert "float32 masters of the weights that train" in composed.notes[0]
    rank_peak = composed.plan.prediction.peak_bytes + composed.per_rank_extra_bytes
    masters = composed.sizes.trainable_half * (2 + 2) // 2  # AdamW: weights, gradients, 2 states
    assert composed.micro_batch == 2 and rank_peak >= held > rank_peak - masters
    # QLoRA over 2 ranks in bitsandbytes' uint8 storage: the packed weights whole on each (a
    # plain tensor, not a shard).
    qlora = LMSetup(seq_len=64, lora_r=8, quant=4, world_size=2, fsdp=True, dtype="bf16",
                    quant_storage="uint8")  # fmt: skip
    spec = lm_spec_at(config, qlora, device="cpu", precision="bf16", sharded=True)(2)
    with fake_ranks(2):
        packed = [m.weight for m in spec.model().modules() if isinstance(m, QuantizedLinear)]
    assert packed and not any(hasattr(w, "_local_tensor") for w in packed)
    assert {w.numel() * 2 for w in packed} >= {256 * 256, 256 * 1024}  # whole: 2 values a byte
    plan = plan_lm(config, qlora, 8, "1GB", device="cpu", precision="bf16", overhead=0)
    assert plan.fsdp_traced and plan.sizes.unsharded > 0
    assert (
        f"the quantized weights ({format_bytes(plan.sizes.unsharded)}) whole on each rank"
        in (plan.notes[0])
    )
    # By default under FSDP2 they are packed in the precision's 16-bit dtype, which FSDP2
    # shards (accelerate's advice): each rank holds half, and the plan says so.
    sharded = replace(qlora, quant_storage="auto")
    spec = lm_spec_at(config, sharded, device="cpu", precision="bf16", sharded=True)(2)
    with fake_ranks(2):
        packed = [m.weight for m in spec.model().modules() if isinstance(m, QuantizedLinear)]
    assert packed and all(w.dtype == torch.bfloat16 for w in packed)
    # 2 values a byte, 2 bytes an element, 2 ranks: every value of q, k and v, and the MLP
    assert {w.to_local().numel() * 2 * 2 * 2 for w in packed} == {256 * 128, 256**2, 256 * 1024}
    plan = plan_lm(config, sharded, 8, "1GB", device="cpu", precision="bf16", overhead=0)
    assert plan.setup.quant_storage == "bf16" and plan.sizes.unsharded == 0
    assert "4-bit in bf16 storage" in plan.setup.describe()
    fp16 = plan_lm(config, replace(sharded, dtype="fp16"), 8, "1GB", device="cpu",
                   precision="fp16", overhead=0)  # fmt: skip
    assert fp16.setup.quant_storage == "fp16"
    with pytest.raises(ValueError, match=r"would cast the packed .* --quant-storage fp16$"):
        plan_lm(config, replace(sharded, quant_storage="bf16"), 8, "1GB", precision="fp16")
    # A torch whose fully_shard cannot leave uint8 ones out (before 2.7): refused with the fix.
    monkeypatch.setattr("bigbatch.memory.lm_setup._fsdp_leaves_out_params", lambda: False)
    with pytest.raises(ValueError, match=r"--qlora with --fsdp needs torch 2\.7 .*bf16\)$"):
        plan_lm(config, qlora, 8, "1GB", device="cpu", precision="bf16", overhead=0)
    again = plan_lm(config, sharded, 8, "1GB", device="cpu", precision="bf16", overhead=0)
    assert again.micro_batch == plan.micro_batch  # no uint8 weights to leave out: planned
    # An 8-bit base: FSDP2 would shard its int8 weights, losing their scales.
    with pytest.raises(ValueError, match=r"--qlora 8 with --fsdp: .* plan --qlora 4, or 8-bit"):
        plan_lm(config, replace(sharded, quant=8), 8, "1GB", device="cpu", overhead=0)


@pytest.mark.slow
def test_an_fsdp2_rank_gathers_and_reduces_on_streams_of_its_own(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """On a GPU, FSDP2 allocates each all-gather's output on its copy-in stream and each
    reduce-scatter's output (the rank's sharded gradients, kept until they are zeroed) on its
    reduce-scatter stream, whose blocks the caching allocator keeps apart from the default
    stream's. The trace of a CUDA rank says which stream each allocation is on. The units are
    accelerate's (a decoder layer, the input embedding, the final norm with the head), their
    float32 masters gathered in bf16 (its mixed-precision policy under Trainer's bf16): each
    unit's bf16 shard and whole weights on one side stream, the bf16 reduce-scatter's shard
    and its float32 cast on another. Replayed on one stream (the control), the same step
    reserves less: the default stream would reuse blocks the side streams freed."""
    from bigbatch.memory import predict as predict_module
    from bigbatch.memory.cuda_allocator import round_size, simulate

    traced: list[list[tuple[str, object, int]]] = []

    def keep(events, limit=None):  # type: ignore[no-untyped-def]
        traced.append(list(events))
        return simulate(events, limit)

    monkeypatch.setattr(predict_module, "simulate", keep)
    setup = LMSetup(seq_len=64, world_size=4, fsdp=True)
    spec = lm_spec_at(fsdp_config(), setup, device="cuda", precision="bf16", sharded=True)(2)
    with fake_ranks(4):
        prediction = predict_peak(spec)
    sizes: dict[object, set[int]] = {}
    stream: object = 0
    for op, key, nbytes in traced[-1]:
        if op == "stream":
            stream = key
        elif op == "malloc" and stream != 0:
            sizes.setdefault(stream, set()).add(nbytes)
    # Weights a unit: a layer's attention, MLP and norms; the embedding; the norm and head.
    units = [2 * 256 * 256 + 2 * 256 * 128 + 3 * 256 * 1024 + 2 * 256, 2048 * 256, 256 + 2048 * 256]
    shards16 = {round_size(2 * u // 4) for u in units}
    assert list(sizes.values()) == [
        {round_size(2 * u) for u in units} | shards16,  # all-gathers: bf16 in, whole bf16 out
        shards16 | {round_size(4 * u // 4) for u in units},  # reduce-scatters, cast to fp32
    ]
    one_stream = simulate([e for e in traced[-1] if e[0] != "stream"])
    assert prediction.reserved_bytes > one_stream.reserved_bytes


@pytest.mark.slow
@pytest.mark.parametrize(
    "setup",
    [
        LMSetup(seq_len=32, lora_r=4, gradient_checkpointing=True),
        LMSetup(seq_len=32, lora_r=4, quant=4),
        LMSetup(seq_len=32, world_size=2, fsdp=True),
    ],
    ids=["lora-ckpt", "qlora", "fsdp2-rank"],
)
def test_a_later_micro_batch_alone_bounds_the_cuda_trace_from_below(setup: LMSetup) -> None:
    """A window's later micro-batch traced alone (live_peak: the optimizer's first step on zero
    gradients, one forward and backward with the gradients held) has the full CUDA trace's
    live peak exactly, and so stays under what the allocator reserves: a bound that rules a
    size out (at a third of the trace) and never one that fits. An FSDP2 rank is not bounded:
    its held gradients are its reduce-scatter's shards."""
    sharded = setup.fsdp
    spec = lm_spec_at(tiny(), setup, device="cuda", precision="bf16", sharded=sharded)(2)
    spec = spec.in_window(8)
    if sharded:  # a rank's held gradients are FSDP2's reduce-scatter shards: not bounded
        with fake_ranks(2):
            assert live_peak(spec) is None
        return
    bound, full = live_peak(spec), predict_peak(spec)
    assert bound is not None and bound.peak_bytes == full.peak_bytes
    assert bound.gradients == full.gradients and bound.reserved_bytes == 0
    assert bound.planning_bytes <= full.planning_bytes
    assert live_peak(replace(spec, device="cpu")) is None  # a CPU trace is that step already


def test_the_gpu_side_builds_bitsandbytes_own_layers_with_the_same_adapters() -> None:
    """What a real step on a GPU runs (the evidence records it): bitsandbytes' Linear4bit under
    peft's adapters, the same adapters as the planner's stand-ins get."""
    bnb = pytest.importorskip("bitsandbytes")
    setup = LMSetup(seq_len=8, lora_r=4, quant=4)
    real = lm_spec_at(tiny(), setup, real_bitsandbytes=True)(1).model()
    planned = build_on_meta(lm_spec_at(tiny(), setup)(1).model)
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in real.modules()) == 14
    assert model_sizes(real).trainable_count == model_sizes(planned).trainable_count
    # Everything but the 4-bit weights in float32, as prepare_model_for_kbit_training leaves it.
    dtypes = {p.dtype for n, p in real.named_parameters() if "base_layer" not in n}
    assert dtypes == {torch.float32}


def test_gpt2s_conv1d_layers_are_quantized_as_transformers_quantizes_them() -> None:
    """GPT-2's projections are transformers' ``Conv1D`` (weight ``[in, out]``), which its
    bitsandbytes integration quantizes as it does ``nn.Linear``: the planner's stand-ins and
    the GPU side's real layers replace the same modules, at the same shapes. Before, they
    stayed in float32 and a QLoRA plan of GPT-2 counted its base unquantized."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear

    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    setup = LMSetup(seq_len=8, lora_r=4, quant=4)

    def names(model: torch.nn.Module, kind: type) -> dict[str, tuple[int, int]]:
        return {
            n.removeprefix("base_model.model.").removesuffix(".base_layer"): (
                m.in_features,
                m.out_features,
            )
            for n, m in model.named_modules()
            if isinstance(m, kind)
        }

    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(cfg)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True)
    replace_with_bnb_linear(theirs, modules_to_not_convert=["lm_head"], quantization_config=config)
    planned = build_on_meta(lm_spec_at(cfg, setup)(1).model)
    real = lm_spec_at(cfg, setup, real_bitsandbytes=True)(1).model()
    expected = names(theirs, bnb.nn.Linear4bit)
    assert len(expected) == 8 and expected["transformer.h.0.attn.c_attn"] == (64, 192)
    assert names(planned, QuantizedLinear) == expected
    assert names(real, bnb.nn.Linear4bit) == expected
    full = model_sizes(build_on_meta(lm_spec_at(cfg, replace(setup, quant=0))(1).model))
    assert model_sizes(planned).parameters < full.parameters
    assert model_sizes(planned).parameter_count == full.parameter_count


def test_a_mixture_of_experts_router_is_left_unquantized_as_transformers_leaves_it() -> None:
    """Llama 4's ``Llama4Router`` is an ``nn.Linear`` subclass: transformers' bitsandbytes
    replacement (with the modules from_pretrained keeps out) leaves it in 16 bits, and so do
    the planner's 4-bit stand-ins; every other linear layer is quantized by both."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.base import get_keys_to_not_convert

    cfg = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100,
        num_local_experts=4, interleave_moe_layer_step=1,
    )  # fmt: skip
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(cfg)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True)
    kept = get_keys_to_not_convert(theirs)
    replace_with_bnb_linear(theirs, modules_to_not_convert=kept, quantization_config=config)
    planned = build_on_meta(lm_spec_at(cfg, LMSetup(seq_len=8, quant=4))(1).model)
    expected = {n for n, m in theirs.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert {n for n, m in planned.named_modules() if isinstance(m, QuantizedLinear)} == expected
    routers = [n for n, m in planned.named_modules() if type(m).__name__ == "Llama4Router"]
    assert len(routers) == 2 and not set(routers) & expected and len(expected) > 2


@pytest.mark.slow
def test_a_base_readied_as_trl_does_is_lighter_by_the_float32_copies() -> None:
    """``qlora_prep="trl"``: the base's other weights as loaded (bf16 here), the adapters in
    bfloat16, where peft's preparation holds both in float32 (the residual stream too, from
    the float32 embedding)."""
    pytest.importorskip("bitsandbytes")
    cfg = tiny(dtype="bfloat16")
    models, plans = {}, {}
    for prep in ("peft", "trl"):
        setup = LMSetup(seq_len=64, lora_r=8, quant=4, qlora_prep=prep)
        models[prep] = build_on_meta(lm_spec_at(cfg, setup)(1).model)
        # On the CPU: a CUDA plan rounds a model this small to the same 2 MiB segments.
        plans[prep] = plan_lm(cfg, setup, 8, "8GB", device="cpu", precision="bf16", overhead=0)

    def dtypes(model: torch.nn.Module, trained: bool) -> set[torch.dtype]:
        held = model.named_parameters()
        return {p.dtype for _, p in held if p.requires_grad == trained and p.is_floating_point()}

    assert dtypes(models["peft"], True) == dtypes(models["peft"], False) == {torch.float32}
    assert dtypes(models["trl"], True) == dtypes(models["trl"], False) == {torch.bfloat16}
    assert plans["trl"].sizes.parameters < plans["peft"].sizes.parameters
    assert plans["trl"].peak_bytes < plans["peft"].peak_bytes
    assert "prepared as TRL's SFTTrainer does" in plans["trl"].setup.describe()


def test_eight_bit_adamw_state_is_bitsandbytes_own() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    from bigbatch.memory.bnb import BnbAdamW

    def state_bytes(opt: torch.optim.Optimizer) -> int:
        # qmap1/qmap2 are one table shared by every weight: counted once
        storages = {
            v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
            for s in opt.state.values()
            for k, v in s.items()
            if torch.is_tensor(v) and not k.startswith("qmap")
        }
        return sum(storages.values())

    sizes = [(8192,), (100,), (300, 200)]
    both = []
    for kind in (bnb.optim.AdamW8bit, BnbAdamW):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = kind(params)
        opt.step()
        both.append(state_bytes(opt))
    assert both[0] == both[1]


def big_vocabulary() -> transformers.LlamaConfig:
    """A small body under a Llama-3-sized vocabulary: the logits decide the peak."""
    return transformers.LlamaConfig(
        vocab_size=128_256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip


@pytest.mark.slow
def test_trls_fused_lm_head_is_traced_as_sft_trainer_runs_it() -> None:
    """--loss trl: the step as TRL's SFTTrainer runs it, through its fused LM head (tiles of
    the logits, never the whole of them). On a CPU TRL folds each tile with torch ops, and the
    prediction is the measured peak; a CUDA trace takes the card's path (its Triton kernels
    stood in for, TRL's module state restored after), where a sequence more adds less than its
    logits, which the model's own loss makes whole (and a float32 copy of)."""
    if not hasattr(pytest.importorskip("trl.trainer.utils"), "add_fused_lm_head"):
        pytest.skip("this TRL has no fused LM head")
    import trl.kernels.chunked_logprob as kernels

    small = transformers.LlamaConfig(
        vocab_size=8000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    for lora in (0, 8):
        spec = lm_spec_at(small, LMSetup(seq_len=128, lora_r=lora, loss="trl"), device="cpu",
                          precision="fp32")(2)  # fmt: skip
        predicted, measured = predict_peak(spec).peak_bytes, measure_step_peak(spec)
        assert abs(predicted - measured) <= 0.01 * measured, (lora, predicted, measured)
    config, seq = big_vocabulary(), 512
    names = ("_use_triton", "_forward_kernel", "_backward_kernel", "_addmm_fp32")
    before = [getattr(kernels, name) for name in names]
    grown = {}
    for loss in ("model", "trl"):
        spec_at = lm_spec_at(config, LMSetup(seq_len=seq, lora_r=8, loss=loss), precision="bf16")
        grown[loss] = predict_peak(spec_at(2)).peak_bytes - predict_peak(spec_at(1)).peak_bytes
    logits = seq * config.vocab_size * 2  # one sequence's, in bf16
    assert grown["model"] > 2 * logits > logits > grown["trl"], grown
    assert [getattr(kernels, name) for name in names] == before


def test_a_fused_lm_head_plan_needs_a_trl_that_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """--loss trl where TRL has no fused LM head (or is missing), and a loss of another name:
    refused in one line with the fix."""
    monkeypatch.setattr("bigbatch.memory.lm_setup._fused_lm_head", lambda: None)
    with pytest.raises(ValueError, match=r"^--loss trl plans TRL's fused LM head, and .*: plan "
                                         r"with --loss model, or pip install -U trl$"):  # fmt: skip
        plan_lm(tiny(), LMSetup(seq_len=16, loss="trl"), 2, "8GB", device="cpu")
    with pytest.raises(ValueError, match=r"^--loss trl plans TRL's fused LM head, and "):
        lm_spec_at(tiny(), LMSetup(seq_len=16, loss="trl"), device="cpu")  # the step alone
    with pytest.raises(ValueError, match=r"^--loss must be one of model, trl, got 'sft'$"):
        plan_lm(tiny(), LMSetup(seq_len=16, loss="sft"), 2, "8GB", device="cpu")
