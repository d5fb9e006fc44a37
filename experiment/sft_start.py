"""The tiny policy and the SFT start every arm shares, built once and cached under the data dir.

A cached start's folder name says roughly what it was trained on and with; its
`config_hash.json` (`fingerprint`) says exactly: the settings `run_sft` reads, the base
config's `sft:` section and the experiment's `train` and `sft_overrides` included.
A start whose stored hash differs from the one just built is refused, in one line naming what
differs, never silently reused.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from core.progress import say
from experiment.config import ExperimentConfig
from experiment.fingerprint import check_reuse, sft_settings, stored_hash, write_hash
from experiment.train_configs import base_train_config, shared_train_config


def short_hash(value: Any) -> str:
    """8 hex digits naming a setting in a cache path ("" for an empty one: the default)."""
    if not value:
        return ""
    return hashlib.sha1(json.dumps(value, sort_keys=True).encode()).hexdigest()[:8]


def policy_hash(cfg: ExperimentConfig) -> str:
    """The hash of the policy's non-default sizes ("" for the default policy)."""
    return short_hash(cfg.policy.model_dump(exclude_defaults=True))


def ensure_policy(cfg: ExperimentConfig) -> Path:
    """The model the SFT start is trained from, under the data dir: `init_model` (converted
    there on first use where it names SmolLM2), else the tiny policy (`tiny-policy`, or
    `tiny-policy-<hash>` for a non-default `policy`), built once."""
    from models.tiny import init_tiny_policy, vital_corpus_texts
    from trainer.tools.sft import ensure_init_model

    if cfg.init_model:
        path = Path(cfg.data_dir) / cfg.init_model
        ensure_init_model(path)
        return path
    tag = policy_hash(cfg)
    path = Path(cfg.data_dir) / ("tiny-policy" + (f"-{tag}" if tag else ""))
    if not (path / "config.json").is_file():
        changed = cfg.policy.model_dump(exclude_defaults=True)
        say(f"experiment: building the tiny policy {path} {changed or ''}".rstrip())
        init_tiny_policy(path, vital_corpus_texts(), cfg.policy)
    return path


def sft_split(cfg: ExperimentConfig) -> str:
    """The split the SFT start learns from: `sft_split`, else RL's own `data.train_split`."""
    return cfg.sft_split or shared_train_config(cfg).data.train_split


def sft_start_dir(cfg: ExperimentConfig) -> Path:
    """Where the SFT start lives under the data dir; its name tells what it was trained on and
    with (`tiny-sft` for the defaults), so starts of different tasks or settings never meet."""
    task = cfg.task if cfg.task != ExperimentConfig.model_fields["task"].default else ""
    split = sft_split(cfg)
    tag = "-".join(
        f"{k}{v}"
        for k, v in (
            ("e", cfg.sft_epochs),
            ("n", cfg.sft_max_examples),
            ("c", cfg.corpus_limit),
            ("p", policy_hash(cfg)),
            ("s", short_hash(cfg.sft_overrides)),
            ("split", split if split != "train" else None),
        )
        if v
    )
    start = f"from-{cfg.sft_from_task}" if cfg.sft_from_task else ""
    model = f"{cfg.init_model}-sft" if cfg.init_model else "tiny-sft"
    name = "-".join(part for part in (model, task, tag, start) if part)
    return Path(cfg.data_dir) / name


def sft_prerequisite(cfg: ExperimentConfig) -> ExperimentConfig | None:
    """The experiment whose SFT start `cfg`'s start is fine-tuned from (`sft_from_task`): that
    task on the base config's settings (its own prompt and turns, not `cfg`'s `train`), same
    data, base config, policy and retriever."""
    if not cfg.sft_from_task:
        return None
    return ExperimentConfig(
        task=cfg.sft_from_task,
        data_dir=cfg.data_dir,
        out_dir=cfg.out_dir,
        base_config=cfg.base_config,
        policy=cfg.policy,
        train={"retrieval": {"retriever": shared_train_config(cfg).retrieval.retriever}},
    )


def ensure_sft(cfg: ExperimentConfig, url: str, log: Path) -> Path:
    """The shared SFT start (`sft_start_dir`), trained once (`run_sft`) and then reused."""
    from trainer.config.history import ADDED_KEYS, REMOVED_KEYS, RENAMED_KEYS
    from trainer.tools.sft import run_sft

    sft_dir = sft_start_dir(cfg)
    prerequisite = sft_prerequisite(cfg)
    init = ensure_sft(prerequisite, url, log) if prerequisite else ensure_policy(cfg)
    config = sft_train_config(cfg, url, sft_dir, init)
    settings = sft_settings(config, init_identity(cfg, init))
    if (sft_dir / "config.json").is_file():  # reused only when made with these settings
        check_reuse(
            sft_dir,
            settings,
            "SFT start",
            renamed=RENAMED_KEYS,
            added=ADDED_KEYS,
            removed=REMOVED_KEYS,
        )
        return sft_dir
    say(f"experiment: SFT start -> {sft_dir} from {init} (once; cached)")
    start = time.perf_counter()
    run_sft(config)
    write_hash(sft_dir, settings)
    with log.open("a") as fh:
        fh.write(f"sft {sft_dir}: {time.perf_counter() - start:.0f}s\n")
    return sft_dir


def sft_train_config(cfg: ExperimentConfig, url: str, sft_dir: Path, init: Path):
    """The TrainConfig `run_sft` trains the start with: the base config (its `sft:` section
    included) with the experiment's `train` and `sft_overrides`."""
    extra = [
        f"sft.init_model={init}",
        f"sft.split={sft_split(cfg)}",
        f"sft.eval_questions={min(100, cfg.final_questions or 100)}",
    ]
    if cfg.sft_epochs:
        extra.append(f"sft.epochs={cfg.sft_epochs}")
    if cfg.sft_max_examples:
        extra.append(f"sft.max_examples={cfg.sft_max_examples}")
    extra += cfg.sft_overrides
    return base_train_config(cfg, url, sft_dir, Path(cfg.out_dir) / "sft", 0, extra)


def model_identity(model_dir: Path) -> str:
    """What a pretrained model is, the same on any machine: the sha256 of the file it was
    converted from (`hdr_source.json`), else of its weights."""
    from models.smollm2 import SOURCE_FILE

    source = model_dir / SOURCE_FILE
    if source.is_file():
        return json.loads(source.read_text())["gguf_sha256"]
    digest = hashlib.sha256()
    for weights in sorted(model_dir.glob("*.safetensors")):
        with weights.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def init_identity(cfg: ExperimentConfig, init: Path) -> dict[str, Any]:
    """What the start is initialised from (the prerequisite start's config hash, or the tiny
    policy's sizes) and the corpus its scripted searches ran over."""
    retriever = shared_train_config(cfg).retrieval.retriever
    environment = {"corpus_limit": cfg.corpus_limit, "retriever": retriever}
    if cfg.sft_from_task:
        return {"sft_start_sha256": stored_hash(init), **environment}
    if cfg.init_model:
        return {"init_model": {cfg.init_model: model_identity(init)}, **environment}
    return {"policy": cfg.policy.model_dump(mode="json"), **environment}
